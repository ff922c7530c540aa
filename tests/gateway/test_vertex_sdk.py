"""Claude through Vertex AI beside the Anthropic API, through the example gateway (uvicorn),
with the official Anthropic SDK as the client and the mock provider as both providers.

`api` is an Anthropic API account on the mock; `gcp` a Vertex account whose key file names the
mock's token endpoint, so every Vertex call carries a token the mock issued for a JWT signed
with a key generated here. The client gets the same answers from both, JSON and streams, and
fails over from one to the other under a 5xx, a 429 and a credential refusal.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest

from servers import example_gateway, serve_in_thread
from switchyard_mw.testing import Behaviour, MockProvider
from vertex_accounts import EMAIL, service_account_file

pytestmark = pytest.mark.integration

VERTEX_NAME = "claude-opus-5@20260101"
VERTEX_PATH = (
    f"/v1/projects/my-project/locations/us-east5/publishers/anthropic/models/{VERTEX_NAME}:"
)
FIRST_TOKEN_SECS = 1.0
"""The api account's first-token limit; the slow provider's first token comes 3 s late."""
REQUEST: dict[str, Any] = {
    "model": "claude-opus-5",
    "max_tokens": 50,
    "messages": [{"role": "user", "content": "hi"}],
}


def config(mock_url: str, key_file: str, untrusted_file: str) -> str:
    return f"""
[llm_clients.api]
base_url = "{mock_url}"
api_key_env = "KEY_A"
auth = "x-api-key"
models = ["claude-opus-5"]
failure_threshold = 1000
first_token_secs = {FIRST_TOKEN_SECS}

[llm_clients.gcp]
kind = "vertex"
base_url = "{mock_url}"
vertex = {{ project = "my-project", region = "us-east5", credentials_file = "{key_file}" }}
models = {{ "claude-opus-5" = "{VERTEX_NAME}", "claude-vertex-only" = "claude-x@1" }}
failure_threshold = 1000
priority = 1

[llm_clients.gcp-revoked]
kind = "vertex"
base_url = "{mock_url}"
vertex = {{ project = "my-project", region = "us-east5", credentials_file = "{untrusted_file}" }}
models = {{ "claude-vertex-only" = "claude-x@1" }}
failure_threshold = 1000
"""


@pytest.fixture(scope="module")
def mock() -> Iterator[tuple[MockProvider, str]]:
    provider = MockProvider()
    with serve_in_thread(provider) as url:
        yield provider, url


@pytest.fixture(scope="module")
def gateway_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gw")


@pytest.fixture(scope="module")
def gateway(
    mock: tuple[MockProvider, str], tmp_path_factory: pytest.TempPathFactory, gateway_dir: Path
) -> Iterator[str]:
    provider, url = mock
    keys = tmp_path_factory.mktemp("keys")
    key_file = service_account_file(keys, provider, url)
    revoked = service_account_file(
        keys, None, url, email="revoked@my-project.iam.gserviceaccount.com"
    )
    text = config(url, str(key_file), str(revoked))
    with example_gateway(text, gateway_dir, {"KEY_A": "key-a"}) as gw:
        yield gw


@pytest.fixture(autouse=True)
def clean_mock(mock: tuple[MockProvider, str]) -> None:
    # Behaviours and records only: the tokens issued and the trusted key stay, as at Google.
    mock[0].reset_behaviours()
    mock[0].clear_requests()


def sdk(gateway: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=gateway, api_key="caller", max_retries=0)


async def ask(gateway: str, *, stream: bool) -> tuple[dict[str, Any], Any]:
    """The answer as the SDK parsed it (a stream: its final message), and the headers."""
    client = sdk(gateway)
    try:
        if stream:
            async with client.messages.stream(**REQUEST) as events:
                text = "".join([chunk async for chunk in events.text_stream])
                message = await events.get_final_message()
                headers = events.response.headers
            assert text == message.content[0].text  # type: ignore[union-attr]
        else:
            raw = await client.messages.with_raw_response.create(**REQUEST)
            message = await raw.parse()
            headers = raw.headers
    finally:
        await client.close()
    return message.model_dump(), headers


def comparable(answer: dict[str, Any]) -> dict[str, Any]:
    """An answer less what differs by nature: its id and the
    input tokens (the mock counts 4 request bytes a token, and the Vertex body is another)."""
    usage = {k: v for k, v in answer["usage"].items() if k != "input_tokens"}
    return {**{k: v for k, v in answer.items() if k != "id"}, "usage": usage}


@pytest.mark.parametrize("stream", [False, True])
async def test_the_sdk_gets_the_same_answer_from_the_api_and_from_vertex(
    gateway: str, mock: tuple[MockProvider, str], stream: bool
) -> None:
    provider, _ = mock
    from_api, api_headers = await ask(gateway, stream=stream)
    assert api_headers["x-switchyard-account"] == "api"
    provider.set_behaviour("key-a", Behaviour(status=503))
    from_vertex, vertex_headers = await ask(gateway, stream=stream)
    assert vertex_headers["x-switchyard-account"] == "gcp"
    assert vertex_headers["x-switchyard-model"] == "claude-opus-5"
    assert comparable(from_vertex) == comparable(from_api)
    assert from_vertex["model"] == from_api["model"] == "claude-opus-5"  # the public name
    assert from_vertex["usage"]["input_tokens"] > 0
    verb = "streamRawPredict" if stream else "rawPredict"
    vertex_call = provider.requests[-1]
    assert (vertex_call.key, vertex_call.path) == (EMAIL, VERTEX_PATH + verb)
    sent = json.loads(vertex_call.body)
    assert "model" not in sent
    assert sent["anthropic_version"] == "vertex-2023-10-16"
    assert vertex_call.headers["authorization"].startswith("Bearer ya29.mock-")
    assert "x-api-key" not in vertex_call.headers  # the caller's key never leaves


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "fault",
    [
        Behaviour(status=503),
        Behaviour(status=500),
        Behaviour(status=429, headers={}),  # no retry time: the account is not held
        Behaviour(status=401),
        Behaviour(status=403),
    ],
    ids=["503", "500", "429", "401", "403"],
)
async def test_failover_from_the_api_to_vertex(
    gateway: str, mock: tuple[MockProvider, str], fault: Behaviour, stream: bool
) -> None:
    provider, _ = mock
    provider.set_behaviour("key-a", fault)
    answer, headers = await ask(gateway, stream=stream)
    assert answer["content"][0]["text"]
    assert headers["x-switchyard-account"] == "gcp"
    assert headers["x-switchyard-attempts"] == "2"
    seen = [(r.key, r.path, r.stream) for r in provider.requests]
    verb = "streamRawPredict" if stream else "rawPredict"
    assert seen == [("key-a", "/v1/messages", stream), (EMAIL, VERTEX_PATH + verb, stream)]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "fault",
    [
        Behaviour(fail="reset_before_headers"),
        # After the headers (and a stream's opening events), before the first token: held
        # back until then, nothing has reached the client.
        Behaviour(fail="reset_mid_stream", stall_after_chunks=0),
    ],
    ids=["cut-before-headers", "cut-before-first-token"],
)
async def test_a_cut_answer_fails_over_from_the_api_to_vertex(
    gateway: str, mock: tuple[MockProvider, str], fault: Behaviour, stream: bool
) -> None:
    provider, _ = mock
    provider.set_behaviour("key-a", fault)
    answer, headers = await ask(gateway, stream=stream)
    assert answer["content"][0]["text"] == "Hello from the mock provider."
    assert headers["x-switchyard-account"] == "gcp"
    assert headers["x-switchyard-attempts"] == "2"
    assert [r.key for r in provider.requests] == ["key-a", EMAIL]


async def test_a_slow_first_token_fails_over_from_the_api_to_vertex(
    gateway: str, mock: tuple[MockProvider, str]
) -> None:
    """The api stream sends its headers at once and its first token 3 s later; past the
    account's `first_token_secs` (1 s) the request goes to Vertex, and the client sees only
    Vertex's stream, well before the api's first token was due."""
    provider, _ = mock
    provider.set_behaviour(
        "key-a", Behaviour(reply="late", stall_after_chunks=0, body_stall_secs=3.0)
    )
    started = time.monotonic()
    answer, headers = await ask(gateway, stream=True)
    took = time.monotonic() - started
    assert answer["content"][0]["text"] == "Hello from the mock provider."
    assert headers["x-switchyard-account"] == "gcp"
    assert headers["x-switchyard-attempts"] == "2"
    assert [(r.key, r.stream) for r in provider.requests] == [("key-a", True), (EMAIL, True)]
    assert FIRST_TOKEN_SECS <= took < 3.0


@pytest.mark.parametrize(
    ("status", "error", "message"),
    [(429, anthropic.RateLimitError, "Vertex AI: RESOURCE_EXHAUSTED: ")],
)
async def test_vertex_errors_reach_the_sdk_in_the_anthropic_shape(
    gateway: str,
    mock: tuple[MockProvider, str],
    status: int,
    error: type[anthropic.APIStatusError],
    message: str,
) -> None:
    provider, _ = mock
    provider.set_behaviour(EMAIL, Behaviour(status=status, headers={}))
    client = sdk(gateway)
    with pytest.raises(error) as info:
        await client.messages.create(**{**REQUEST, "model": "claude-vertex-only"})
    await client.close()
    assert info.value.status_code == status
    assert info.value.body["type"] == "error"  # type: ignore[index]
    assert info.value.body["error"]["message"].startswith(message)  # type: ignore[index]


async def test_a_vertex_refusal_of_its_credentials_is_the_credential_503(
    gateway: str, mock: tuple[MockProvider, str]
) -> None:
    """Google's 403 PERMISSION_DENIED on the only account of the model: the provider refused
    *its* credentials, never the client's: the 503 that says so, in the Anthropic shape."""
    provider, _ = mock
    provider.set_behaviour(EMAIL, Behaviour(status=403, headers={}))
    client = sdk(gateway)
    with pytest.raises(anthropic.APIStatusError) as info:
        await client.messages.create(**{**REQUEST, "model": "claude-vertex-only"})
    await client.close()
    assert info.value.status_code == 503
    assert info.value.response.headers["x-should-retry"] == "false"
    assert info.value.body["type"] == "error"  # type: ignore[index]
    assert info.value.body["error"]["type"] == "no_healthy_account"  # type: ignore[index]
    assert "refused the credentials" in info.value.body["error"]["message"]  # type: ignore[index]


async def test_the_openai_wire_is_refused_by_a_vertex_account(gateway: str) -> None:
    import httpx

    async with httpx.AsyncClient(base_url=gateway) as client:
        answer = await client.post(
            "/v1/chat/completions",
            json={"model": "claude-vertex-only", "messages": [{"role": "user", "content": "x"}]},
        )
    assert answer.status_code == 404
    assert "Anthropic Messages API" in answer.json()["error"]["message"]


async def test_a_vertex_account_whose_key_is_refused_fails_over_naming_no_secret(
    gateway: str, mock: tuple[MockProvider, str], gateway_dir: Path
) -> None:
    provider, _ = mock
    client = sdk(gateway)
    raw = await client.messages.with_raw_response.create(
        **{**REQUEST, "model": "claude-vertex-only"}
    )
    await client.close()
    assert (await raw.parse()).content[0].type == "text"
    assert raw.headers["x-switchyard-account"] == "gcp"
    assert raw.headers["x-switchyard-attempts"] == "2"
    # The revoked account never reached the model: its token request was refused.
    assert [r.key for r in provider.requests] == [EMAIL]
    log = (gateway_dir / "gateway.log").read_text()
    assert "ya29." not in log
    assert "PRIVATE KEY" not in log


async def test_a_vertex_stream_cut_mid_way_ends_with_the_anthropic_error_event(
    gateway: str, mock: tuple[MockProvider, str]
) -> None:
    provider, _ = mock
    provider.set_behaviour(EMAIL, Behaviour(fail="reset_mid_stream", stall_after_chunks=1))
    client = sdk(gateway)
    received: list[str] = []

    async def read() -> None:
        async with client.messages.stream(**{**REQUEST, "model": "claude-vertex-only"}) as events:
            async for text in events.text_stream:
                received.append(text)

    with pytest.raises(anthropic.APIStatusError) as info:
        await read()
    await client.close()
    assert received  # the first delta reached the client before the cut
    assert "upstream stream failed" in str(info.value)


async def test_count_tokens_fails_over_from_the_api_to_vertex(
    gateway: str, mock: tuple[MockProvider, str]
) -> None:
    provider, _ = mock
    provider.set_behaviour("key-a", Behaviour(status=503))
    client = sdk(gateway)
    try:
        raw = await client.messages.with_raw_response.count_tokens(
            model="claude-opus-5", messages=REQUEST["messages"]
        )
        counted = await raw.parse()
    finally:
        await client.close()
    assert raw.headers["x-switchyard-account"] == "gcp"
    assert raw.headers["x-switchyard-attempts"] == "2"
    seen = [(r.key, r.path) for r in provider.requests]
    assert seen == [
        ("key-a", "/v1/messages/count_tokens"),
        (EMAIL, VERTEX_PATH[: -len(VERTEX_NAME) - 1] + "count-tokens:rawPredict"),
    ]
    sent = json.loads(provider.requests[-1].body)
    # Vertex takes a count with the model in the body (its own name) and the API version.
    assert (sent["model"], sent["anthropic_version"]) == (VERTEX_NAME, "vertex-2023-10-16")
    assert counted.input_tokens == max(1, len(provider.requests[-1].body) // 4)
