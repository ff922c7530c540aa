"""A stream's first content event under a real Envoy running examples/envoy/envoy.yaml, with the
official SDK: an account that sends its headers and opening events at once and its first
content late is failed over before the client saw a byte (the first-token filter holds the
attempt's headers), and with no other account the client gets the wire's 504.

The mock runs under uvicorn on a thread, the processor on this module's event loop (both
transports), Envoy once for the module; each test installs its own config.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import pytest
import pytest_asyncio

from envoy_rig import Rig, StartRig
from switchyard_mw.telemetry import names as tm
from switchyard_mw.testing import DEFAULT_REPLY, Behaviour

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration]
KEYS = {"KEY_A": "key-a", "KEY_B": "key-b"}
QUESTION: Any = [{"role": "user", "content": "hi"}]
FIRST_TOKEN_SECS = 0.5
LATE = Behaviour(stall_after_chunks=0, body_stall_secs=3.0)
"""Headers and the opening events at once, the first content event 3 s later."""


def config_text(mock_url: str, b_first_token_secs: float = FIRST_TOKEN_SECS) -> str:
    # `solo` is served by `a` alone; `pair` by `a` then `b`.
    return f"""
[llm_clients.a]
base_url = "{mock_url}"
api_key_env = "KEY_A"
auth = "x-api-key"
models = ["pair", "solo"]
priority = 0
first_token_secs = {FIRST_TOKEN_SECS}
envoy_cluster = "mock"

[llm_clients.b]
base_url = "{mock_url}"
api_key_env = "KEY_B"
auth = "x-api-key"
models = ["pair"]
priority = 1
first_token_secs = {b_first_token_secs}
envoy_cluster = "mock"
"""


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def rig(start_rig: StartRig) -> AsyncIterator[Rig]:
    async with start_rig(config_text, KEYS) as rig:
        await _warm_up(rig)
        yield rig


def sdk(rig: Rig) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=rig.envoy_url, api_key="caller", max_retries=0)


async def _pair_stream(rig: Rig) -> tuple[Any, float, list[Any]]:
    """A stream of `pair` read whole with the SDK: its raw response, the seconds to its
    headers and its events."""
    started = time.monotonic()
    async with sdk(rig) as client:
        raw = await client.messages.with_raw_response.create(
            model="pair", max_tokens=9, messages=QUESTION, stream=True
        )
        headers_after = time.monotonic() - started
        events = [event async for event in await raw.parse()]
    return raw, headers_after, events


async def _warm_up(rig: Rig) -> None:
    """One stream read with the SDK: its first parse of events builds its models (about a
    second on a loaded machine), which would otherwise count in the first test's times."""
    rig.configure()
    async with sdk(rig) as client:
        stream = await client.messages.create(
            model="pair", max_tokens=9, messages=QUESTION, stream=True
        )
        assert [event.type async for event in stream][-1] == "message_stop"


async def test_a_late_first_token_fails_over_before_the_client_saw_a_byte(
    rig: Rig, otel_metrics: Any
) -> None:
    policies = rig.configure()
    expired = otel_metrics.value(tm.DEADLINE_EXCEEDED, phase="first_token")
    rig.mock.set_behaviour("key-a", LATE)
    started = time.monotonic()
    raw, headers_after, events = await _pair_stream(rig)
    took = time.monotonic() - started
    # One well-formed stream, all of it the second account's.
    types = [event.type for event in events]
    assert types[0] == "message_start"
    assert types[-1] == "message_stop"
    assert types.count("message_start") == 1
    text = "".join(
        e.delta.text
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "text_delta"
    )
    assert text == DEFAULT_REPLY
    assert raw.headers["x-switchyard-account"] == "b"
    assert [r.key for r in rig.mock.requests] == ["key-a", "key-b"]
    assert FIRST_TOKEN_SECS <= headers_after < FIRST_TOKEN_SECS + 1.0, headers_after
    assert took < LATE.body_stall_secs, took  # before the first account's content was due
    # The first attempt is a deadline fault of its account and model, phase first_token.
    assert policies.pool.status_of("a", model="pair").consecutive_faults == 1
    assert otel_metrics.value(tm.DEADLINE_EXCEEDED, phase="first_token") == expired + 1


async def test_with_no_account_left_the_client_gets_the_wires_504(
    rig: Rig, otel_metrics: Any
) -> None:
    rig.configure()
    rig.mock.set_behaviour("key-a", LATE)
    expired = otel_metrics.value(tm.DEADLINE_EXCEEDED, phase="first_token")
    started = time.monotonic()
    async with sdk(rig) as client:
        with pytest.raises(anthropic.APIStatusError) as info:
            await client.messages.create(model="solo", max_tokens=9, messages=QUESTION, stream=True)
    took = time.monotonic() - started
    assert info.value.status_code == 504
    assert info.value.body["error"]["type"] == "deadline_exceeded"  # type: ignore[index]
    assert FIRST_TOKEN_SECS <= took < FIRST_TOKEN_SECS + 1.0, took
    assert [r.key for r in rig.mock.requests] == ["key-a"]
    assert otel_metrics.value(tm.DEADLINE_EXCEEDED, phase="first_token") == expired + 1


B_FIRST_TOKEN_SECS = 5.0
B_LATER = Behaviour(stall_after_chunks=0, body_stall_secs=1.5)
"""b's first content after 1.5 s: later than `a`'s bound, well within its own."""


async def test_the_retry_runs_under_its_own_accounts_bound(rig: Rig, otel_metrics: Any) -> None:
    # Envoy reads the per-try timeout once, at routing, for every try of the request: were it
    # `a`'s 0.5 s, `b`'s try would be cut there too (measured: a 504 after about 1.1 s, and
    # `b` charged a fault) where the ASGI front waits for `b`'s own 5 s.
    policies = rig.configure(b_first_token_secs=B_FIRST_TOKEN_SECS)
    rig.mock.set_behaviour("key-a", LATE)
    rig.mock.set_behaviour("key-b", B_LATER)
    expired = otel_metrics.value(tm.DEADLINE_EXCEEDED, phase="first_token")
    raw, headers_after, events = await _pair_stream(rig)
    assert [event.type for event in events][-1] == "message_stop"
    assert raw.headers["x-switchyard-account"] == "b"
    # What bound the attempt that served: b's own.
    assert raw.headers["x-switchyard-deadline-ms"] == str(int(B_FIRST_TOKEN_SECS * 1000))
    assert [r.key for r in rig.mock.requests] == ["key-a", "key-b"]
    due = FIRST_TOKEN_SECS + B_LATER.body_stall_secs
    assert due <= headers_after < due + 1.0, headers_after
    assert policies.pool.status_of("a", model="pair").consecutive_faults == 1
    assert policies.pool.status_of("b", model="pair").consecutive_faults == 0
    assert otel_metrics.value(tm.DEADLINE_EXCEEDED, phase="first_token") == expired + 1


async def test_headers_later_than_the_accounts_bound_are_cut_at_the_longest_reach(
    rig: Rig,
) -> None:
    # What the longest bound leaves (docs/envoy.md): before its headers a try has no message
    # the processor could answer, so `a`'s headers, late past its own 0.5 s, are cut at the
    # per-try timeout, `b`'s 2 s; the retry on `b` serves, and `a` is charged the deadline.
    policies = rig.configure(b_first_token_secs=2.0)
    rig.mock.set_behaviour("key-a", Behaviour(headers_delay_secs=5.0))
    raw, headers_after, events = await _pair_stream(rig)
    assert [event.type for event in events][-1] == "message_stop"
    assert raw.headers["x-switchyard-account"] == "b"
    assert 2.0 <= headers_after < 3.0, headers_after
    assert policies.pool.status_of("a", model="pair").consecutive_faults == 1
    assert policies.pool.status_of("b", model="pair").consecutive_faults == 0
