"""Hostile but plausible request bodies through the example gateway: each gets a clean answer.

A body nested near Python's recursion limit, a model no account serves, a model name unfit for
a header, a body that never finishes arriving. In process (the whole stack around the example's
Starlette app and forwarder, the mock provider under uvicorn) and under real uvicorn as a user
runs the example, driven by the official SDKs where a client is involved.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator

import anthropic
import httpx
import openai
import pytest
import pytest_asyncio
from starlette.applications import Starlette
from starlette.routing import Route

from servers import example_gateway, serve_in_thread
from switchyard_mw.asgi.stack import switchyard_stack
from switchyard_mw.clients.outbound import make_http_client
from switchyard_mw.config import parse_config
from switchyard_mw.gateway import WIRE_ROUTES, Forwarder
from switchyard_mw.testing import Behaviour, MockProvider

pytestmark = pytest.mark.asyncio(loop_scope="module")
ENV = {"KEY_A": "key-a", "JUDGE_KEY": "judge-key"}


def config(mock_url: str, *, server: str = "") -> str:
    return f"""
[server]
{server}

[llm_clients.a]
base_url = "{mock_url}"
api_key_env = "KEY_A"
models = ["claude-opus-5", "claude-haiku-5", "gpt-5"]

[llm_clients.judge]
base_url = "{mock_url}"
api_key_env = "JUDGE_KEY"
models = ["gpt-judge"]

[routes.auto]
classifier = "llm"
judge = "judge"
judge_model = "gpt-judge"
judge_deadline_ms = 5000
choices = {{ simple = "claude-haiku-5", complex = "claude-opus-5" }}
fallback = "claude-opus-5"
"""


def nested(depth: int, *, model: str = "auto", path: str = "/v1/messages") -> bytes:
    """A body whose last user turn's content nests `depth` arrays deep."""
    content = "[" * depth + "]" * depth
    cap = "max_tokens" if path == "/v1/messages" else "max_completion_tokens"
    return (
        f'{{"model":"{model}","{cap}":5,"messages":[{{"role":"user","content":{content}}}]}}'
    ).encode()


@pytest.fixture(scope="module")
def mock() -> Iterator[tuple[MockProvider, str]]:
    provider = MockProvider()
    with serve_in_thread(provider) as url:
        yield provider, url


@pytest.fixture(autouse=True)
def judge_answers(mock: tuple[MockProvider, str]) -> None:
    mock[0].reset()
    mock[0].set_behaviour(ENV["JUDGE_KEY"], Behaviour(reply="simple"))


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def in_process(mock: tuple[MockProvider, str]) -> AsyncIterator[httpx.AsyncClient]:
    """The example gateway's app (stack, Starlette, forwarder) called in this process."""
    http = make_http_client()
    forwarder = Forwarder(http)
    app = Starlette(routes=[Route(path, forwarder, methods=["POST"]) for path in WIRE_ROUTES])
    stack = switchyard_stack(app, config=parse_config(config(mock[1])), environ=ENV)
    transport = httpx.ASGITransport(app=stack, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw.test") as client:
        yield client
    await stack.aclose()
    await http.aclose()


@pytest.fixture(scope="module")
def gateway(
    mock: tuple[MockProvider, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """`uvicorn examples.starlette_app:app`, as a user runs it."""
    text = config(mock[1], server="body_read_timeout_secs = 0.5")
    with example_gateway(text, tmp_path_factory.mktemp("gw"), ENV) as url:
        yield url


def clean(reply: httpx.Response, depth: int) -> str:
    """What a reply to a nested body says: the promised 400, or the judge's routing."""
    if reply.status_code == 400:
        assert reply.json()["error"]["type"] == "invalid_request_error", (depth, reply.text)
        assert "nests too deeply" in reply.json()["error"]["message"]
        return "400"
    assert reply.status_code == 200, (depth, reply.status_code, reply.text[:200])
    assert reply.headers["x-switchyard-route"] == "judge:simple", depth
    assert reply.headers["x-switchyard-model"] == "claude-haiku-5", depth
    return "judged"


# --- nesting ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/chat/completions"])
async def test_every_depth_near_the_limit_is_judged_or_refused_never_a_500(
    in_process: httpx.AsyncClient, mock: tuple[MockProvider, str], path: str
) -> None:
    outcomes = {}
    for depth in range(940, 1011):
        reply = await in_process.post(
            path, content=nested(depth, path=path), headers={"content-type": "application/json"}
        )
        outcomes[depth] = clean(reply, depth)
    # One limit: every depth up to it is judged, every depth past it refused.
    judged = [d for d, outcome in outcomes.items() if outcome == "judged"]
    refused = [d for d, outcome in outcomes.items() if outcome == "400"]
    assert judged
    assert refused
    assert max(judged) < min(refused)


@pytest.mark.integration
async def test_nested_bodies_under_real_uvicorn_are_judged_or_refused(gateway: str) -> None:
    async with httpx.AsyncClient(base_url=gateway, timeout=10) as client:
        seen = set()
        for depth in (960, 967, 970, 975, 981, 982, 990, 1000, 5000):
            reply = await client.post(
                "/v1/messages", content=nested(depth), headers={"content-type": "application/json"}
            )
            seen.add(clean(reply, depth))
    assert seen == {"judged", "400"}


# --- a model no account serves ---------------------------------------------------------------


async def test_a_model_no_account_serves_is_a_404_in_the_wires_format(
    in_process: httpx.AsyncClient, mock: tuple[MockProvider, str]
) -> None:
    turn = [{"role": "user", "content": "hi"}]
    reply = await in_process.post(
        "/v1/messages", json={"model": "no-such-model", "max_tokens": 5, "messages": turn}
    )
    assert reply.status_code == 404
    assert reply.json() == {
        "type": "error",
        "error": {"type": "not_found_error", "message": reply.json()["error"]["message"]},
    }
    assert "`no-such-model`" in reply.json()["error"]["message"]
    reply = await in_process.post(
        "/v1/chat/completions", json={"model": "no-such-model", "messages": turn}
    )
    assert reply.status_code == 404
    assert reply.json()["error"]["code"] == "model_not_found"
    assert mock[0].requests == []


@pytest.mark.integration
async def test_a_model_no_account_serves_is_a_404_each_sdk_raises(gateway: str) -> None:
    turn: list[anthropic.types.MessageParam] = [{"role": "user", "content": "hi"}]
    claude = anthropic.AsyncAnthropic(base_url=gateway, api_key="caller", max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as refused:
        await claude.messages.create(model="no-such-model", max_tokens=5, messages=turn)
    assert "`no-such-model`" in refused.value.message
    gpt = openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key="caller", max_retries=0)
    with pytest.raises(openai.NotFoundError) as missing:
        await gpt.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}]
        )
    assert missing.value.code == "model_not_found"
    assert "`no-such-model`" in missing.value.message


# --- model names unfit for a header ----------------------------------------------------------


BAD_NAMES = ["claude-opus-5\r\nx-injected: 1", "claude-opus-5\u0000", "m" * 100_000]


@pytest.mark.parametrize("model", BAD_NAMES)
async def test_a_model_name_unfit_for_a_header_is_a_400(
    in_process: httpx.AsyncClient, mock: tuple[MockProvider, str], model: str
) -> None:
    body = {"model": model, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    reply = await in_process.post("/v1/messages", content=json.dumps(body))
    assert reply.status_code == 400
    assert reply.json()["error"]["type"] == "invalid_request_error"
    assert "x-switchyard-model" not in reply.headers
    assert len(reply.content) < 1000  # the name is not echoed in the body either
    assert mock[0].requests == []


@pytest.mark.integration
@pytest.mark.parametrize("model", BAD_NAMES)
async def test_a_model_name_unfit_for_a_header_is_a_400_under_real_uvicorn(
    gateway: str, model: str
) -> None:
    gpt = openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key="caller", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        await gpt.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
    assert refused.value.code == "invalid_request_error"
    assert sum(len(k) + len(v) for k, v in refused.value.response.headers.items()) < 1000
    # The server is still well: the next request is answered.
    reply = await gpt.chat.completions.create(
        model="gpt-5", messages=[{"role": "user", "content": "hi"}]
    )
    assert reply.choices[0].message.content


# --- a body that never finishes arriving -----------------------------------------------------


async def half_a_body(base_url: str) -> tuple[bytes, float]:
    """Send the head and half the declared body, then nothing: (what came back, seconds)."""
    host, port = base_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    body = json.dumps(
        {"model": "claude-opus-5", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    ).encode()
    head = (
        f"POST /v1/messages HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()
    writer.write(head + body[: len(body) // 2])
    await writer.drain()
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        async with asyncio.timeout(10):
            answer = await reader.read()  # to the end: the server closes the connection
        return answer, loop.time() - started
    finally:
        writer.close()


@pytest.mark.integration
async def test_a_body_that_stops_arriving_gets_a_408_and_the_server_keeps_serving(
    gateway: str,
) -> None:
    answers = await asyncio.gather(*(half_a_body(gateway) for _ in range(5)))
    for answer, waited in answers:
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), answer[:200]
        assert json.loads(body)["error"]["type"] == "request_timeout"
        assert waited < 5  # the bound is 0.5 s; ten times it is plenty on a loaded machine
    claude = anthropic.AsyncAnthropic(base_url=gateway, api_key="caller", max_retries=0)
    reply = await claude.messages.create(
        model="claude-opus-5", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
    )
    assert reply.content
