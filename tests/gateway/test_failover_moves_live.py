"""Failover where one account serves a model and its chain's model, over real sockets: the
example gateway under uvicorn, the mock provider, the official SDKs (default retries).

Each scenario has its own account (its own key at the mock) serving a model `X` and the model
of `X`'s chain, `X-mini`, so what failed in one request is the pair (account, `X`), or, for
a refused key or billing, the whole account:

- `X` overloaded on the account: the very first request gets `X-mini` from the same account;
- another account of `X`: it serves first, before the chain;
- a short retry time on the account's `X` (`retry_wait_max_secs`): the same account after the
  wait, before the chain; failing again after it: then the chain, on the same account;
- a refused key or billing: never the provider's 401/400/429, never the chain on the same
  account: the 503 saying the credentials were refused, at once.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from servers import example_gateway, serve_in_thread
from switchyard_mw.testing import Behaviour, MockProvider

pytestmark = pytest.mark.integration

MESSAGES: Any = [{"role": "user", "content": "Say hello"}]
REFUSED = "the upstream refused the credentials of every account"
SCENARIOS = {
    # account: (its models, retry_wait_max_secs, priority)
    "pair": (["pair", "pair-mini"], 0, 0),
    "first": (["first", "first-mini"], 0, 0),
    "second": (["first"], 0, 1),
    "wait": (["wait", "wait-mini"], 3, 0),
    "again": (["again", "again-mini"], 3, 0),
    "key": (["key", "key-mini"], 3, 0),
    "bill-a": (["bill-a", "bill-a-mini"], 3, 0),
    "bill-o": (["bill-o", "bill-o-mini"], 3, 0),
}
CHAINS = ["pair", "first", "wait", "again", "key", "bill-a", "bill-o"]


def _config(mock_url: str) -> str:
    accounts = "".join(
        f"""
[llm_clients.{name}]
base_url = "{mock_url}"
api_key_env = "KEY_{name.upper().replace("-", "_")}"
models = {models!r}
priority = {priority}
retry_wait_max_secs = {wait}
""".replace("'", '"')
        for name, (models, wait, priority) in SCENARIOS.items()
    )
    chains = "".join(f'"{m}" = {{ models = ["{m}-mini"], on = ["unavailable"] }}\n' for m in CHAINS)
    return accounts + "\n[fallbacks]\n" + chains


@pytest.fixture(scope="module")
def mock() -> Iterator[MockProvider]:
    provider = MockProvider()
    with serve_in_thread(provider) as url:
        provider.url = url  # type: ignore[attr-defined]
        yield provider


@pytest.fixture(scope="module")
def gateway(mock: MockProvider, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    keys = {f"KEY_{n.upper().replace('-', '_')}": f"key-{n}" for n in SCENARIOS}
    url: str = mock.url  # type: ignore[attr-defined]
    with example_gateway(_config(url), tmp_path_factory.mktemp("moves"), keys) as gw:
        yield gw


def _sent(mock: MockProvider, key: str) -> list[str | None]:
    """The models the mock was asked for with `key`, in order."""
    return [r.model for r in mock.requests if r.key == f"key-{key}"]


async def test_a_pair_that_fails_sends_the_first_request_to_the_chain_on_the_same_account(
    gateway: str, mock: MockProvider
) -> None:
    mock.set_behaviour("key-pair", Behaviour(status=529, status_models=["pair"]))
    async with anthropic.AsyncAnthropic(base_url=gateway, api_key="x") as client:
        raw = await client.messages.with_raw_response.create(
            model="pair", max_tokens=8, messages=MESSAGES
        )
    message = await raw.parse()
    assert message.content[0].type == "text"
    assert raw.headers["x-switchyard-model"] == "pair-mini"
    assert raw.headers["x-switchyard-account"] == "pair"
    assert raw.headers["x-switchyard-route"] == "fallback:unavailable"
    assert raw.headers["x-switchyard-attempts"] == "2"
    assert _sent(mock, "pair") == ["pair", "pair-mini"]


async def test_another_account_of_the_model_comes_before_the_chain(
    gateway: str, mock: MockProvider
) -> None:
    mock.set_behaviour("key-first", Behaviour(status=503, status_models=["first"]))
    async with openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key="x") as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="first", messages=MESSAGES
        )
    assert raw.parse().choices[0].message.content
    assert raw.headers["x-switchyard-model"] == "first"
    assert raw.headers["x-switchyard-account"] == "second"
    assert "x-switchyard-route" not in raw.headers
    assert _sent(mock, "first") == ["first"]
    assert _sent(mock, "second") == ["first"]


@pytest.mark.parametrize(
    ("behaviour", "least_secs"),
    [
        (Behaviour(status=429, times=1, headers={"retry-after": "1"}), 1.0),
        (Behaviour(status=500, times=1), 0.5),
    ],
    ids=["429 retry-after 1", "500 once"],
)
async def test_a_short_wait_on_the_same_account_comes_before_the_chain(
    gateway: str, mock: MockProvider, behaviour: Behaviour, least_secs: float
) -> None:
    mock.set_behaviour("key-wait", behaviour)
    mock.clear_requests()
    started = time.perf_counter()
    async with openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key="x") as client:
        raw = await client.responses.with_raw_response.create(model="wait", input="Say hello")
    took = time.perf_counter() - started
    assert raw.parse().output_text
    assert raw.headers["x-switchyard-model"] == "wait"  # the model asked for, after a wait
    assert raw.headers["x-switchyard-attempts"] == "2"
    assert "x-switchyard-route" not in raw.headers
    assert _sent(mock, "wait") == ["wait", "wait"]
    print(f"retried in place after {took:.3f} s")
    assert least_secs <= took < least_secs + 5, took


async def test_failing_again_after_the_wait_then_the_chain_on_the_same_account(
    gateway: str, mock: MockProvider
) -> None:
    mock.set_behaviour("key-again", Behaviour(status=500, status_models=["again"]))
    client = anthropic.AsyncAnthropic(base_url=gateway, api_key="x")
    async with (
        client,
        client.messages.with_streaming_response.create(
            model="again", max_tokens=8, messages=MESSAGES, stream=True
        ) as raw,
    ):
        body = await raw.text()
    assert "message_stop" in body
    assert raw.headers["x-switchyard-model"] == "again-mini"
    assert raw.headers["x-switchyard-route"] == "fallback:unavailable"
    assert raw.headers["x-switchyard-attempts"] == "3"
    assert _sent(mock, "again") == ["again", "again", "again-mini"]


async def test_a_refused_key_is_the_credential_503_at_once_never_the_chain_on_it(
    gateway: str, mock: MockProvider
) -> None:
    mock.set_behaviour("key-key", Behaviour(status=401))
    sent: list[object] = []

    async def note(request: object) -> None:
        sent.append(request)

    http = anthropic.DefaultAsyncHttpxClient(event_hooks={"request": [note]})
    async with anthropic.AsyncAnthropic(base_url=gateway, api_key="x", http_client=http) as client:
        with pytest.raises(anthropic.InternalServerError) as error:
            await client.messages.create(model="key", max_tokens=8, messages=MESSAGES)
    assert error.value.status_code == 503
    assert REFUSED in str(error.value)
    assert error.value.response.headers["x-should-retry"] == "false"
    assert error.value.response.headers["x-switchyard-attempts"] == "1"
    assert len(sent) == 1  # the SDK did not retry
    assert _sent(mock, "key") == ["key"]  # no wait, no chain on the refused account


@pytest.mark.parametrize("wire", ["anthropic", "chat", "responses"])
async def test_a_billing_refusal_is_the_credential_503_never_a_hold_or_the_client_s_400(
    gateway: str, mock: MockProvider, wire: str
) -> None:
    account = "bill-a" if wire == "anthropic" else "bill-o"
    mock.set_behaviour(f"key-{account}", Behaviour(refuse="billing"))
    mock.clear_requests()
    if wire == "anthropic":
        async with anthropic.AsyncAnthropic(base_url=gateway, api_key="x") as claude:
            with pytest.raises(anthropic.InternalServerError) as claude_error:
                await claude.messages.create(model=account, max_tokens=8, messages=MESSAGES)
        response = claude_error.value.response
    else:
        async with openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key="x") as gpt:
            call = (
                gpt.chat.completions.create(model=account, messages=MESSAGES)
                if wire == "chat"
                else gpt.responses.create(model=account, input="Say hello")
            )
            with pytest.raises(openai.InternalServerError) as gpt_error:
                await call
        response = gpt_error.value.response
    assert response.status_code == 503
    assert REFUSED in response.json()["error"]["message"]
    assert response.headers["x-should-retry"] == "false"
    assert _sent(mock, account) == [account]  # once: no wait, no chain on it, no SDK retry
    async with httpx.AsyncClient(base_url=gateway) as http:
        accounts = (await http.get("/switchyard/accounts")).json()["accounts"]
    state = next(a for a in accounts if a["name"] == account)
    assert state["consecutive_faults"] >= 1  # counted against the account's key
    assert not state.get("held_for_secs")  # never a throttle hold
