"""Hedged first tokens through the example gateway under uvicorn, with the official SDKs.

Account `slow` (preferred) sends its headers at once and its first token after `STALL_SECS`;
`fast` answers at once. With `hedge_after_secs` on `slow`, a request gets a hedge on `fast`
after `HEDGE_AFTER_SECS`: the client's first token comes from `fast` soon after, the slow
upstream request is cancelled (the mock's `in_flight` drops to 0), and `slow` is charged
nothing. `hedge_max_ratio = 0.5`: each model's first requests are warmed on a `slow` that
answers at once (counted in the window, no hedge), so the hedges below fit the budget; a
model's first request in a fresh window never does (`budget` shows the refusal).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from servers import example_gateway, serve_in_thread
from switchyard_mw.testing import Behaviour, MockProvider

pytestmark = pytest.mark.integration

HEDGE_AFTER_SECS = 0.3
STALL_SECS = 3.0
MARGIN_SECS = 1.0
"""The first token within `HEDGE_AFTER_SECS` + this (the fast account's time, a loaded host)."""
SLOW = Behaviour(reply="slow slow slow", stall_after_chunks=0, body_stall_secs=STALL_SECS)
FAST = Behaviour(reply="fast fast fast")
BUDGET_STALL_SECS = 1.0
SLOW_BUDGET = Behaviour(
    reply="slow but sure", stall_after_chunks=0, body_stall_secs=BUDGET_STALL_SECS
)
WARM = 3
"""Requests per model answered at once before the hedges (`gateway`): at a ratio of 0.5, room
for the two hedges of each model below (a third would need a fourth request)."""
HI = {"role": "user", "content": "hi"}

CONFIG = f"""
[server]
hedge_max_ratio = 0.5

[llm_clients.slow]
base_url = "{{mock}}"
api_key_env = "KEY_SLOW"
auth = "x-api-key"
models = ["h-stream", "h-json"]
timeout_secs = 30
stream_idle_secs = 30
first_token_secs = 30
hedge_after_secs = {HEDGE_AFTER_SECS}

[llm_clients.slow_budget]
base_url = "{{mock}}"
api_key_env = "KEY_SLOWB"
auth = "x-api-key"
models = ["h-budget"]
timeout_secs = 30
hedge_after_secs = {HEDGE_AFTER_SECS}

[llm_clients.fast]
base_url = "{{mock}}"
api_key_env = "KEY_FAST"
auth = "x-api-key"
models = ["h-stream", "h-json", "h-budget"]
priority = 1
"""


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, MockProvider]]:
    provider = MockProvider()
    provider.set_behaviour("key-slow", FAST)  # warm first: counted, never hedged
    provider.set_behaviour("key-fast", FAST)
    provider.set_behaviour("key-slowb", SLOW_BUDGET)
    env = {"KEY_SLOW": "key-slow", "KEY_FAST": "key-fast", "KEY_SLOWB": "key-slowb"}
    with serve_in_thread(provider) as mock_url:
        config = CONFIG.replace("{mock}", mock_url)
        with example_gateway(config, tmp_path_factory.mktemp("hedge"), env) as url:
            # Each SDK's first call once (its first use costs it more than any later one),
            # then plain requests: WARM per model in all.
            for call, model, _ in CALLS.values():
                call(url, model)
            with httpx.Client(base_url=url, timeout=30) as client:
                for model in ("h-json", "h-stream"):
                    body = {"model": model, "max_tokens": 8, "messages": [HI]}
                    assert client.post("/v1/messages", json=body).status_code == 200
            provider.set_behaviour("key-slow", SLOW)
            yield url, provider


def _scrape(gateway: str) -> str:
    return httpx.get(f"{gateway}/metrics").text


def _metric(scraped: str, name: str, *labels: str) -> float:
    total = 0.0
    for line in scraped.splitlines():
        series, _, value = line.rpartition(" ")
        if series.startswith(name + "{") and all(label in series for label in labels):
            total += float(value)
    return total


def _hedges(scraped: str, model: str, result: str) -> float:
    return _metric(scraped, "switchyard_hedges_total", f'"{model}"', f'result="{result}"')


def _faults(scraped: str, account: str) -> float:
    return _metric(scraped, "switchyard_account_faults_total", f'switchyard_account="{account}"')


def _anthropic_stream(url: str, model: str = "h-stream") -> tuple[str, float]:
    client = anthropic.Anthropic(base_url=url, api_key="caller", max_retries=0, timeout=30)
    text, first = "", 0.0
    started = time.monotonic()
    with client.messages.stream(
        model=model, max_tokens=64, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        for piece in stream.text_stream:
            first = first or time.monotonic() - started
            text += piece
    return text, first


def _chat_stream(url: str, model: str = "h-stream") -> tuple[str, float]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="caller", max_retries=0, timeout=30)
    text, first = "", 0.0
    started = time.monotonic()
    for chunk in client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], stream=True
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.monotonic() - started
            text += chunk.choices[0].delta.content
    return text, first


def _anthropic_json(url: str, model: str = "h-json") -> tuple[str, float]:
    client = anthropic.Anthropic(base_url=url, api_key="caller", max_retries=0, timeout=30)
    started = time.monotonic()
    raw = client.messages.with_raw_response.create(
        model=model, max_tokens=8, messages=[{"role": "user", "content": "hi"}]
    )
    took = time.monotonic() - started
    assert raw.headers["x-switchyard-account"] in ("fast", "slow")
    message = raw.parse()
    return "".join(block.text for block in message.content if block.type == "text"), took


def _chat_json(url: str, model: str = "h-json") -> tuple[str, float]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="caller", max_retries=0, timeout=30)
    started = time.monotonic()
    raw = client.chat.completions.with_raw_response.create(
        model=model, max_completion_tokens=8, messages=[{"role": "user", "content": "hi"}]
    )
    took = time.monotonic() - started
    answer = raw.parse()
    return (answer.choices[0].message.content or "") + "|" + raw.headers[
        "x-switchyard-account"
    ], took


CALLS = {
    "anthropic-stream": (_anthropic_stream, "h-stream", FAST.reply),
    "chat-stream": (_chat_stream, "h-stream", FAST.reply),
    "anthropic-json": (_anthropic_json, "h-json", FAST.reply),
    "chat-json": (_chat_json, "h-json", f"{FAST.reply}|fast"),
}


def _idle_upstream(provider: MockProvider, within_secs: float) -> float | None:
    """How long until no request is in flight at the mock (None: not within the bound)."""
    started = time.monotonic()
    while provider.in_flight:
        if time.monotonic() - started > within_secs:
            return None
        time.sleep(0.01)
    return time.monotonic() - started


@pytest.mark.parametrize("case", list(CALLS))
def test_a_stalled_first_token_is_hedged_and_the_slow_call_cancelled(
    gateway: tuple[str, MockProvider], case: str
) -> None:
    url, provider = gateway
    call, model, expected = CALLS[case]
    before = _scrape(url)
    text, first = call(url, model)
    answered = time.monotonic()
    assert text == expected  # the fast account's answer, nothing of the slow one's
    assert HEDGE_AFTER_SECS <= first < HEDGE_AFTER_SECS + MARGIN_SECS
    # The slow upstream request was cancelled at once: nothing is in flight within 1 s.
    idle = _idle_upstream(provider, 1.0)
    assert idle is not None, f"{provider.in_flight} still in flight 1 s after the answer"
    assert time.monotonic() - answered < 1.5
    assert [r.key for r in provider.requests[-2:]] == ["key-slow", "key-fast"]
    after = _scrape(url)
    assert _hedges(after, model, "won") == _hedges(before, model, "won") + 1
    assert _faults(after, "slow") == _faults(before, "slow")  # losing a race is no fault


def test_the_budget_refuses_a_hedge_it_has_not_earned(gateway: tuple[str, MockProvider]) -> None:
    """`h-budget`'s first request: one request in the window, at 0.5 no hedge is owed; the
    slow account answers after its stall, and only it was asked."""
    url, provider = gateway
    before = _scrape(url)
    asked = len(provider.requests)
    text, took = _chat_json(url, "h-budget")
    assert text == f"{SLOW_BUDGET.reply}|slow_budget"
    assert took >= BUDGET_STALL_SECS
    assert [r.key for r in provider.requests[asked:]] == ["key-slowb"]
    refused = _hedges(before, "h-budget", "refused")
    assert _hedges(_scrape(url), "h-budget", "refused") == refused + 1
