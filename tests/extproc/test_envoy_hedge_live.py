"""Hedged first tokens under a real Envoy running examples/envoy/envoy.yaml, with the official
SDK (`extproc/hedge_tries.py`): with `[server] envoy_hedge`, a stream or a JSON answer whose
account is slow to its first content gets a second try on another account at its hedge time
(the route's `hedge_policy`), the try with content first is the answer, and the other's lease
goes back as the race says (lost: no outcome; refused or late: its account's fault).

The mock runs under uvicorn on a thread, the processor on this module's event loop (both
transports), Envoy once for the module; each test installs its own config.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

import anthropic
import pytest
import pytest_asyncio

from envoy_rig import Rig, StartRig
from switchyard_mw.extproc import Policies
from switchyard_mw.telemetry import names as tm
from switchyard_mw.testing import Behaviour

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration]
KEYS = {"KEY_A": "key-a", "KEY_B": "key-b"}
QUESTION: Any = [{"role": "user", "content": "hedge me"}]
HEDGE_SECS = 0.4
LATE_SECS = 2.5


def config_text(mock_url: str, *, hedge: bool = True, ratio: float = 1.0) -> str:
    # `pair` is served by `a` then `b`, both hedging after 0.4 s without content.
    return f"""
[server]
envoy_hedge = {"true" if hedge else "false"}
hedge_max_ratio = {ratio}

[llm_clients.a]
base_url = "{mock_url}"
api_key_env = "KEY_A"
auth = "x-api-key"
models = ["pair"]
priority = 0
first_token_secs = 10
hedge_after_secs = {HEDGE_SECS}
envoy_cluster = "mock"

[llm_clients.b]
base_url = "{mock_url}"
api_key_env = "KEY_B"
auth = "x-api-key"
models = ["pair"]
priority = 1
first_token_secs = 10
hedge_after_secs = {HEDGE_SECS}
envoy_cluster = "mock"
"""


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def rig(start_rig: StartRig) -> AsyncIterator[Rig]:
    async with start_rig(config_text, KEYS) as rig:
        rig.configure()
        await _stream(rig)  # the SDK's first parse of events builds its models
        yield rig


def _prompts(rig: Rig, key: str) -> int:
    """How many requests carrying the question reached the mock with `key`."""
    return sum(1 for r in rig.mock.requests if r.key == key and b"hedge me" in r.body)


async def _stream(rig: Rig) -> tuple[Any, float, str]:
    """One streamed answer: the raw response, seconds to its first text, and its text."""
    started = time.monotonic()
    first: float | None = None
    text = ""
    sdk = anthropic.AsyncAnthropic(base_url=rig.envoy_url, api_key="caller", max_retries=0)
    async with sdk as client:
        raw = await client.messages.with_raw_response.create(
            model="pair", max_tokens=9, messages=QUESTION, stream=True
        )
        async for event in await raw.parse():
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                first = first if first is not None else time.monotonic() - started
                text += event.delta.text
    assert first is not None
    return raw, first, text


def _faults(policies: Policies, account: str) -> int:
    return policies.engine.pool.status_of(account).consecutive_faults


async def _answer(rig: Rig) -> tuple[Any, float, str]:
    """One JSON answer: the raw response, seconds to it, and its text."""
    started = time.monotonic()
    sdk = anthropic.AsyncAnthropic(base_url=rig.envoy_url, api_key="caller", max_retries=0)
    async with sdk as client:
        raw = await client.messages.with_raw_response.create(
            model="pair", max_tokens=9, messages=QUESTION
        )
        message = await raw.parse()
    text = "".join(block.text for block in message.content if block.type == "text")
    return raw, time.monotonic() - started, text


@dataclass(frozen=True)
class Shape:
    """How a client asks (a stream, or a whole JSON answer) and how an account is slow to its
    content in that shape."""

    ask: Callable[[Rig], Awaitable[tuple[Any, float, str]]]
    """One call: the raw response, seconds to its first text, and its text."""
    slow: Callable[[float], Behaviour]
    """An answer whose content comes that many seconds late: a stream's first content event
    after its headers and opening events; a JSON answer's headers (it comes when ready)."""


SHAPES = {
    "stream": Shape(_stream, lambda secs: Behaviour(stall_after_chunks=0, body_stall_secs=secs)),
    "json": Shape(_answer, lambda secs: Behaviour(headers_delay_secs=secs)),
}


@pytest.fixture(params=list(SHAPES.values()), ids=list(SHAPES))
def shape(request: pytest.FixtureRequest) -> Shape:
    return cast(Shape, request.param)


async def test_a_slow_answer_is_hedged_and_the_hedge_wins(
    rig: Rig, shape: Shape, otel_metrics: Any
) -> None:
    policies = rig.configure()
    won = otel_metrics.value(tm.HEDGES, result="won")
    rig.mock.set_behaviour("key-a", shape.slow(LATE_SECS))
    raw, first, text = await shape.ask(rig)
    assert text
    assert HEDGE_SECS <= first < LATE_SECS
    assert raw.headers["x-switchyard-account"] == "b"
    assert raw.headers["x-switchyard-attempts"] == "2"
    assert (_prompts(rig, "key-a"), _prompts(rig, "key-b")) == (1, 1)
    assert otel_metrics.value(tm.HEDGES, result="won") == won + 1
    assert _faults(policies, "a") == 0  # a lost race says nothing against its account


async def test_an_answer_in_time_is_not_hedged(rig: Rig, shape: Shape) -> None:
    rig.configure()
    raw, first, text = await shape.ask(rig)
    assert text
    assert first < HEDGE_SECS * 4
    assert raw.headers["x-switchyard-account"] == "a"
    assert raw.headers["x-switchyard-attempts"] == "1"
    assert (_prompts(rig, "key-a"), _prompts(rig, "key-b")) == (1, 0)


async def test_a_refused_hedge_loses_and_the_first_try_answers(
    rig: Rig, shape: Shape, otel_metrics: Any
) -> None:
    policies = rig.configure()
    lost = otel_metrics.value(tm.HEDGES, result="lost")
    rig.mock.set_behaviour("key-a", shape.slow(1.2))
    rig.mock.set_behaviour("key-b", Behaviour(status=503))
    raw, first, text = await shape.ask(rig)
    assert text
    assert first >= 1.2
    assert raw.headers["x-switchyard-account"] == "a"
    assert _prompts(rig, "key-b") == 1
    assert _faults(policies, "b") == 1  # the hedge's 503 is its account's fault
    assert _faults(policies, "a") == 0
    assert otel_metrics.value(tm.HEDGES, result="lost") == lost + 1


async def test_a_first_try_refused_during_the_race_leaves_the_hedge(
    rig: Rig, shape: Shape, otel_metrics: Any
) -> None:
    policies = rig.configure()
    won = otel_metrics.value(tm.HEDGES, result="won")
    # `a` answers 503 after the hedge started, before `b` (the hedge) has its content.
    rig.mock.set_behaviour("key-a", Behaviour(status=503, headers_delay_secs=HEDGE_SECS * 2))
    rig.mock.set_behaviour("key-b", shape.slow(1.2))
    raw, first, text = await shape.ask(rig)
    assert text
    assert raw.headers["x-switchyard-account"] == "b"
    assert HEDGE_SECS + 1.2 <= first < LATE_SECS
    assert _prompts(rig, "key-b") == 1
    # b's answer is the hedge's (a retry after a's 503 would count no hedge).
    assert otel_metrics.value(tm.HEDGES, result="won") == won + 1
    assert _faults(policies, "a") == 1  # its 503 is its account's fault
    assert _faults(policies, "b") == 0


async def test_with_no_hedge_budget_the_second_try_carries_no_prompt(
    rig: Rig, shape: Shape
) -> None:
    policies = rig.configure(ratio=0.0)
    rig.mock.set_behaviour("key-a", shape.slow(1.2))
    raw, first, text = await shape.ask(rig)
    assert text
    assert first >= 1.2  # the first try's answer, waited for
    assert raw.headers["x-switchyard-account"] == "a"
    assert (_prompts(rig, "key-a"), _prompts(rig, "key-b")) == (1, 0)
    assert len(rig.mock.requests) == 2  # the void try went out with neither key nor prompt
    assert _faults(policies, "a") == 0


async def test_without_envoy_hedge_the_slow_stream_is_waited_for(rig: Rig) -> None:
    rig.configure(hedge=False)
    rig.mock.set_behaviour("key-a", Behaviour(stall_after_chunks=0, body_stall_secs=1.0))
    raw, first, _ = await _stream(rig)
    assert first >= 1.0  # no per-try timeout at the hedge time: the stream was not cut
    assert raw.headers["x-switchyard-account"] == "a"
    assert _prompts(rig, "key-b") == 0
