"""`Judge` (switchyard_mw.engine.judge): the pin rule for conversations carrying signed thinking.

The judge is the mock provider in process (httpx ASGITransport): these tests are about which
verdict is used, not about the network, which tests/asgi/test_judge.py covers.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import pytest

from switchyard_mw.accounts import Account
from switchyard_mw.config import LLMClient, Route
from switchyard_mw.engine.judge import Judge
from switchyard_mw.telemetry import names as tm
from switchyard_mw.testing import Behaviour, MockProvider
from switchyard_mw.wire import Wire, read_request

ROUTE = Route(
    classifier="llm",
    judge="judge",
    judge_model="gpt-judge",
    choices={"simple": "small-model", "complex": "big-model"},
    fallback="fallback-model",
    judge_deadline_ms=300,
)


@pytest.fixture
async def setup() -> AsyncIterator[tuple[MockProvider, Judge]]:
    mock = MockProvider()
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=mock), base_url="http://judge")
    client = Account(
        name="judge", spec=LLMClient(base_url="http://judge", models=["*"]), api_key="k"
    )
    judge = Judge(routes={"auto": ROUTE}, accounts={"judge": client}, http_client=http)
    yield mock, judge
    await http.aclose()


def turn(first: str, *, thinking: bool, user_id: str | None = None) -> bytes:
    """An Anthropic body: `first` is the conversation's first user turn."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": first}]
    if thinking:
        blocks = [
            {"type": "thinking", "thinking": "hmm", "signature": "c2lnbmVk"},
            {"type": "text", "text": "Let me check."},
        ]
        messages += [{"role": "assistant", "content": blocks}, {"role": "user", "content": "go"}]
    body: dict[str, Any] = {"model": "auto", "max_tokens": 10, "messages": messages}
    if user_id:
        body["metadata"] = {"user_id": user_id}
    return msgspec.json.encode(body)


async def decide(judge: Judge, body: bytes) -> Any:
    return await judge.decide("auto", read_request(Wire.ANTHROPIC, body), body, None)


async def test_a_pinned_turn_reuses_its_conversations_verdict(
    setup: tuple[MockProvider, Judge],
) -> None:
    mock, judge = setup
    mock.set_behaviour("k", Behaviour(reply="simple"))
    first = await decide(judge, turn("Plan a trip", thinking=False))
    assert (first.model, first.route_header, first.cached) == ("small-model", "judge:simple", False)

    mock.set_behaviour("k", Behaviour(reply="complex"))  # the judge would now move it
    pinned = await decide(judge, turn("Plan a trip", thinking=True))
    assert (pinned.model, pinned.route_header, pinned.cached) == (
        "small-model",
        "judge:simple",
        True,
    )
    assert len(mock.requests) == 1  # the judge was not consulted for the pinned turn


async def test_an_unpinned_turn_is_judged_again_and_updates_the_pin(
    setup: tuple[MockProvider, Judge],
) -> None:
    mock, judge = setup
    mock.set_behaviour("k", Behaviour(reply="simple"))
    await decide(judge, turn("Plan a trip", thinking=False))
    mock.set_behaviour("k", Behaviour(reply="complex"))
    again = await decide(judge, turn("Plan a trip", thinking=False))
    assert again.model == "big-model"
    pinned = await decide(judge, turn("Plan a trip", thinking=True))
    assert (pinned.model, pinned.cached) == ("big-model", True)


async def test_a_pinned_turn_is_not_moved_by_a_stalled_judge(
    setup: tuple[MockProvider, Judge], otel_metrics: Any
) -> None:
    mock, judge = setup
    mock.set_behaviour("k", Behaviour(reply="simple"))
    await decide(judge, turn("Write a poem", thinking=False))
    mock.set_behaviour("k", Behaviour(headers_delay_secs=5))
    before = otel_metrics.value(tm.CLASSIFIER_FAIL_OPEN, route="auto", reason="deadline")
    pinned = await asyncio.wait_for(decide(judge, turn("Write a poem", thinking=True)), 2)
    assert pinned.model == "small-model"  # not the fallback
    after = otel_metrics.value(tm.CLASSIFIER_FAIL_OPEN, route="auto", reason="deadline")
    assert after == before  # nothing failed: the judge was never asked


async def test_a_fail_open_is_remembered_for_the_conversations_pinned_turns(
    setup: tuple[MockProvider, Judge],
) -> None:
    mock, judge = setup
    mock.set_behaviour("k", Behaviour(status=500))
    first = await decide(judge, turn("Sort this list", thinking=False))
    assert (first.model, first.route_header) == ("fallback-model", "fail_open:http_error")
    mock.set_behaviour("k", Behaviour(reply="simple"))
    pinned = await decide(judge, turn("Sort this list", thinking=True))
    assert (pinned.model, pinned.cached) == ("fallback-model", True)


async def test_a_forgotten_pinned_conversation_is_judged_afresh(
    setup: tuple[MockProvider, Judge], otel_metrics: Any
) -> None:
    mock, judge = setup
    mock.set_behaviour("k", Behaviour(headers_delay_secs=5))
    before = otel_metrics.value(tm.CLASSIFIER_FAIL_OPEN, route="auto", reason="deadline")
    decision = await decide(judge, turn("Never seen", thinking=True))
    assert (decision.model, decision.route_header) == ("fallback-model", "fail_open:deadline")
    after = otel_metrics.value(tm.CLASSIFIER_FAIL_OPEN, route="auto", reason="deadline")
    assert after == before + 1


async def test_the_pin_cache_is_bounded(setup: tuple[MockProvider, Judge]) -> None:
    mock, judge = setup
    judge._pin_cache_size = 2
    mock.set_behaviour("k", Behaviour(reply="simple"))
    for first in ("one", "two", "three"):
        await decide(judge, turn(first, thinking=False))
    mock.set_behaviour("k", Behaviour(reply="complex"))
    assert (await decide(judge, turn("three", thinking=True))).cached
    evicted = await decide(judge, turn("one", thinking=True))
    assert (evicted.model, evicted.cached) == ("big-model", False)
    assert len(judge._pins) == 2


async def test_a_conversation_without_a_first_turn_is_never_pinned(
    setup: tuple[MockProvider, Judge],
) -> None:
    mock, judge = setup
    mock.set_behaviour("k", Behaviour(reply="simple"))
    body = msgspec.json.encode({"model": "auto", "input": "hi", "previous_response_id": "r1"})
    view = read_request(Wire.OPENAI_RESPONSES, body)
    assert view.first_turn_hash is None
    await judge.decide("auto", view, body, None)
    assert len(judge._pins) == 0


async def test_without_judge_deadline_ms_the_judge_accounts_timeout_secs_bounds_it() -> None:
    # The docs' promise for an unset judge_deadline_ms: a judge that never answers still
    # cannot hold a request without a budget for longer than its account's timeout_secs.
    mock = MockProvider()
    mock.set_behaviour("k", Behaviour(headers_delay_secs=30))
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=mock), base_url="http://judge")
    spec = LLMClient(base_url="http://judge", models=["*"], timeout_secs=0.2)
    client = Account(name="judge", spec=spec, api_key="k")
    route = msgspec.structs.replace(ROUTE, judge_deadline_ms=None)
    judge = Judge(routes={"auto": route}, accounts={"judge": client}, http_client=http)
    try:
        body = turn("Plan a trip", thinking=False)
        decision = await asyncio.wait_for(decide(judge, body), 10)  # not 30 s
    finally:
        await http.aclose()
    assert (decision.model, decision.route_header) == ("fallback-model", "fail_open:deadline")
