"""Every key refused, over real sockets: the example gateway under uvicorn, the mock provider
refusing every account's key, and the official SDKs with their default retries (2).

Once the accounts cool, a call must fail at once with switchyard's 503 saying the credentials
were refused, not wait out the cooling period in `retry-after` twice and fail anyway (before:
`retry-after: 30`, 60 s per call). An outage keeps its `retry-after`.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from servers import example_gateway, serve_in_thread
from switchyard_mw.testing import Behaviour, MockProvider

pytestmark = pytest.mark.integration

MESSAGES: Any = [{"role": "user", "content": "Say hello"}]
ACCOUNTS = {  # account -> the model it serves; two accounts each
    **{f"r{s}{n}": f"refused-{s}" for s in (401, 402, 403) for n in ("a", "b")},
    "down-a": "down",
    "down-b": "down",
    "mix-refused": "mix",
    "mix-down": "mix",
}
REFUSED = "the upstream refused the credentials of every account (401, 402 or 403)"
FAIL_FAST_SECS = 5.0
"""Bound of a whole SDK call, default retries on (measured: 16-120 ms once warm, up to 1.2 s
for a client's first call on a loaded machine); before, 60 s: two waits of `retry-after: 30`."""


def _config(mock_url: str) -> str:
    return "".join(
        f"""
[llm_clients.{name}]
base_url = "{mock_url}"
api_key_env = "KEY_{name.upper().replace("-", "_")}"
auth = "x-api-key"
models = ["{model}"]
failure_threshold = 1
cooldown_secs = 30
"""
        for name, model in ACCOUNTS.items()
    )


@pytest.fixture(scope="module")
def mock() -> Iterator[MockProvider]:
    provider = MockProvider()
    with serve_in_thread(provider) as url:
        provider.url = url  # type: ignore[attr-defined]
        yield provider


@pytest.fixture(scope="module")
def gateway(mock: MockProvider, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    keys = {f"KEY_{n.upper().replace('-', '_')}": f"key-{n}" for n in ACCOUNTS}
    url: str = mock.url  # type: ignore[attr-defined]
    with example_gateway(_config(url), tmp_path_factory.mktemp("refusals"), keys) as gw:
        yield gw


async def _cool(gateway: str, mock: MockProvider, statuses: dict[str, int], model: str) -> None:
    """Make each account answer its status; one request then faults and cools every one."""
    for name, status in statuses.items():
        mock.set_behaviour(f"key-{name}", Behaviour(status=status))
    async with httpx.AsyncClient(base_url=gateway, timeout=10) as client:
        first = await client.post(
            "/v1/messages", json={"model": model, "max_tokens": 8, "messages": MESSAGES}
        )
        accounts = (await client.get("/switchyard/accounts")).json()["accounts"]
    assert first.headers["x-switchyard-attempts"] == "2"  # both tried
    if all(status in (401, 402, 403) for status in statuses.values()):
        # A provider refusing its own key is never the client's 401: the 503 at once.
        assert first.status_code == 503
        assert REFUSED in first.json()["error"]["message"]
        assert first.headers["x-should-retry"] == "false"
    else:
        assert first.status_code in statuses.values()  # the answer that is no key's
    states = {a["name"]: (a["state"], a["cause"]) for a in accounts if a["name"] in statuses}
    expected = {
        name: ("cooled", "credentials" if status in (401, 402, 403) else "outage")
        for name, status in statuses.items()
    }
    assert states == expected
    mock.clear_requests()


def _sdk_calls(
    gateway: str, model: str, sent: list[str]
) -> dict[str, Callable[[], Awaitable[Any]]]:
    """One call per wire, each through a client with default retries; every request the
    clients send (first tries and retries) is appended to `sent`."""

    async def note(request: Any) -> None:
        sent.append(str(request.url))

    hooks: Any = {"request": [note]}
    oa = openai.AsyncOpenAI(
        base_url=f"{gateway}/v1",
        api_key="x",
        http_client=openai.DefaultAsyncHttpxClient(event_hooks=hooks),
    )
    an = anthropic.AsyncAnthropic(
        base_url=gateway,
        api_key="x",
        http_client=anthropic.DefaultAsyncHttpxClient(event_hooks=hooks),
    )

    async def anthropic_stream() -> None:
        async with an.messages.stream(model=model, max_tokens=8, messages=MESSAGES) as stream:
            async for _ in stream:
                pass

    return {
        "openai chat": lambda: oa.chat.completions.create(model=model, messages=MESSAGES),
        "openai responses": lambda: oa.responses.create(model=model, input="Say hello"),
        "anthropic messages": lambda: an.messages.create(
            model=model, max_tokens=8, messages=MESSAGES
        ),
        "anthropic stream": anthropic_stream,
    }


@pytest.mark.parametrize("status", [401, 402, 403])
async def test_every_key_refused_fails_fast_in_every_sdk(
    gateway: str, mock: MockProvider, status: int
) -> None:
    model = f"refused-{status}"
    await _cool(gateway, mock, {f"r{status}a": status, f"r{status}b": status}, model)
    async with httpx.AsyncClient(base_url=gateway, timeout=10) as client:
        raw = await client.post("/v1/chat/completions", json={"model": model, "messages": MESSAGES})
    assert raw.status_code == 503
    assert raw.json()["error"]["type"] == "no_healthy_account"
    assert REFUSED in raw.json()["error"]["message"]
    assert "retry-after" not in raw.headers
    assert raw.headers["x-should-retry"] == "false"
    took = {}
    sent: list[str] = []
    for name, call in _sdk_calls(gateway, model, sent).items():
        sent.clear()
        started = time.perf_counter()
        with pytest.raises((openai.InternalServerError, anthropic.InternalServerError)) as error:
            await call()
        took[name] = time.perf_counter() - started
        assert error.value.status_code == 503, name
        assert REFUSED in str(error.value), name
        assert len(sent) == 1, (name, sent)  # the SDK did not retry
    print(f"{status}: seconds per SDK call, default retries: "
          + ", ".join(f"{k} {v:.3f}" for k, v in took.items()))  # fmt: skip
    assert max(took.values()) < FAIL_FAST_SECS, took
    assert mock.requests == []  # no upstream call: the accounts are cooling


async def test_an_outage_keeps_the_retry_after_of_its_recovery(
    gateway: str, mock: MockProvider
) -> None:
    await _cool(gateway, mock, {"down-a": 503, "down-b": 503}, "down")
    async with anthropic.AsyncAnthropic(base_url=gateway, api_key="x", max_retries=0) as client:
        with pytest.raises(anthropic.InternalServerError) as error:
            await client.messages.create(model="down", max_tokens=8, messages=MESSAGES)
    response = error.value.response
    assert response.json()["error"] == {
        "type": "no_healthy_account",
        "message": "no healthy upstream account for model 'down'",
    }
    assert 25 <= int(response.headers["retry-after"]) <= 30
    assert "x-should-retry" not in response.headers


async def test_in_a_mix_the_outages_recovery_decides(gateway: str, mock: MockProvider) -> None:
    await _cool(gateway, mock, {"mix-refused": 401, "mix-down": 500}, "mix")
    async with httpx.AsyncClient(base_url=gateway, timeout=10) as client:
        response = await client.post(
            "/v1/messages", json={"model": "mix", "max_tokens": 8, "messages": MESSAGES}
        )
    assert response.status_code == 503
    assert response.json()["error"]["message"] == (
        "no healthy upstream account for model 'mix'; the credentials of some were refused"
    )
    assert 25 <= int(response.headers["retry-after"]) <= 30
    assert "x-should-retry" not in response.headers
