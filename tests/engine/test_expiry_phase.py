"""What an expiry means: the phase a deadline that fired ran out in (`expiry_phase`).

One rule for both fronts. Each front reports what it saw (the clock, the caller's budget,
whether the answer started, whether a successful start is held for its first content, when
the stream's throughput floor passes, how early its own timer may fire) and the machine
answers the phase. Behind Envoy the machine asks it with its own facts (`AttemptMachine.phase`);
the ASGI front's exchange asks it with what its `send` saw.
"""

from __future__ import annotations

import msgspec
import pytest
from test_machine import Env, is_send

from switchyard_mw.context import RequestContext
from switchyard_mw.engine.attempts import Phase
from switchyard_mw.engine.machine import expiry_phase, expiry_resumable
from switchyard_mw.wire import Wire, read_request

EARLY = 0.001  # the ASGI front's timer: asyncio may run it up to its clock resolution early
BUDGET_AT = 100.0


def stream_phase(now: float, **facts: object) -> Phase:
    return expiry_phase(now, BUDGET_AT, stream=True, early=EARLY, **facts)  # type: ignore[arg-type]


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("started", [True, False])
def test_the_budget_ends_it_from_its_time_less_the_timers_earliness(
    stream: bool, started: bool
) -> None:
    def at(now: float) -> Phase:
        return expiry_phase(now, BUDGET_AT, stream=stream, started=started, early=EARLY)

    assert at(BUDGET_AT) is Phase.BUDGET
    assert at(BUDGET_AT + EARLY) is Phase.BUDGET
    assert at(BUDGET_AT - EARLY) is Phase.BUDGET  # exactly as early as the timer may fire
    assert at(BUDGET_AT - 0.0011) is not Phase.BUDGET  # sooner: the attempt's own bound
    assert at(BUDGET_AT - 5.0) is not Phase.BUDGET


def test_a_timer_that_never_fires_early_ends_the_budget_at_its_time() -> None:
    assert expiry_phase(BUDGET_AT, BUDGET_AT, stream=True, started=False) is Phase.BUDGET
    assert expiry_phase(BUDGET_AT - 1e-6, BUDGET_AT, stream=True, started=False) is Phase.HEADERS


def test_a_bound_the_budget_cut_is_the_budgets_whenever_it_fires() -> None:
    # Behind Envoy the machine gave the bound: when the budget cut it, its end is the caller's.
    assert expiry_phase(50.0, BUDGET_AT, stream=False, started=False, budget_bound=True) is (
        Phase.BUDGET
    )
    assert expiry_phase(50.0, None, stream=True, started=True, budget_bound=True) is Phase.BUDGET


def test_no_budget_never_means_budget() -> None:
    assert expiry_phase(1e9, None, stream=False, started=False, early=EARLY) is Phase.TOTAL
    assert expiry_phase(1e9, None, stream=True, started=False, early=EARLY) is Phase.HEADERS


def test_a_json_answer_runs_out_of_its_total_whatever_it_got_to() -> None:
    for started in (True, False):
        for held in (True, False):
            phase = expiry_phase(
                50.0,
                BUDGET_AT,
                stream=False,
                started=started,
                early=EARLY,
                start_held=held,
                first_token_sooner=held,
                slow_at=10.0,
            )
            assert phase is Phase.TOTAL


def test_a_stream_that_never_started_ran_out_of_its_headers() -> None:
    assert stream_phase(50.0, started=False) is Phase.HEADERS


def test_a_stream_whose_first_token_bound_is_the_sooner_ran_out_of_its_first_token() -> None:
    # The ASGI front's rule (through it, not behind Envoy: a recorded difference).
    assert stream_phase(50.0, started=False, first_token_sooner=True) is Phase.FIRST_TOKEN


def test_a_successful_start_held_for_its_first_content_ran_out_of_its_first_token() -> None:
    assert stream_phase(50.0, started=False, start_held=True) is Phase.FIRST_TOKEN
    # The budget comes first all the same.
    assert stream_phase(BUDGET_AT - EARLY, started=False, start_held=True) is Phase.BUDGET


def test_a_started_stream_ran_out_of_its_idle_gap() -> None:
    assert stream_phase(50.0, started=True) is Phase.IDLE
    # What held the start no longer counts once it went on.
    assert stream_phase(50.0, started=True, start_held=True, first_token_sooner=True) is (
        Phase.IDLE
    )


def test_a_started_stream_is_slow_from_its_floors_time_less_the_timers_earliness() -> None:
    slow_at = 40.0
    assert stream_phase(slow_at, started=True, slow_at=slow_at) is Phase.SLOW
    assert stream_phase(slow_at + 1.0, started=True, slow_at=slow_at) is Phase.SLOW
    assert stream_phase(slow_at - EARLY, started=True, slow_at=slow_at) is Phase.SLOW
    assert stream_phase(slow_at - 0.0011, started=True, slow_at=slow_at) is Phase.IDLE
    assert stream_phase(slow_at - 0.0011, started=True, slow_at=None) is Phase.IDLE
    # Not started: the floor is not running yet, whatever its time says.
    assert stream_phase(slow_at, started=False, slow_at=slow_at) is Phase.HEADERS
    # The budget before the floor.
    assert stream_phase(BUDGET_AT, started=True, slow_at=slow_at) is Phase.BUDGET


def test_the_machine_asks_the_same_rule_with_its_own_facts() -> None:
    env = Env()
    m = env.machine()
    assert is_send("a")(m.begin())
    m.deadline(env.clock.now)
    assert m.phase() is Phase.TOTAL  # not a stream
    assert m.phase(started=True) is Phase.TOTAL
    env.ctx.budget_at = env.clock.now + 1e-6  # past its bound: not cut by it
    assert m.phase() is Phase.TOTAL  # no earliness behind Envoy: the budget is not yet over
    env.clock.now = env.ctx.budget_at
    assert m.phase() is Phase.BUDGET


def test_the_machine_names_a_streams_headers_and_idle_gap() -> None:
    env = Env()
    body = msgspec.json.encode(
        {
            "model": "m",
            "max_tokens": 8,
            "stream": True,
            "messages": [{"role": "user", "content": "hi"}],
        }
    )
    env.ctx = RequestContext(read_request(Wire.ANTHROPIC, body), body, env.clock.now)
    m = env.machine()
    assert is_send("a")(m.begin())
    m.deadline(env.clock.now)
    assert m.phase() is Phase.HEADERS  # behind Envoy a stream that never started
    assert m.phase(started=True) is Phase.IDLE


@pytest.mark.parametrize("phase", list(Phase))
def test_a_started_stream_that_expired_may_be_resumed_unless_the_budget_ended_it(
    phase: Phase,
) -> None:
    # No time is left for a continuation once the caller's budget is over.
    assert expiry_resumable(phase) is (phase is not Phase.BUDGET)
    assert expiry_resumable(str(phase)) is (phase is not Phase.BUDGET)  # a front's label
