"""What the machine decides that the fronts used to: a hedge's time, budget and outcome, the
first content event's deadline, and the 504 of a stream whose first content was late.

Sans-IO: plain events in, actions out, an injected clock. Accounts a (hedges after 0.5 s, a
first-token limit of 2 s) and b (no hedge, no first-token limit: its `timeout_secs`, 30 s)
serve `m`, a preferred.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx
import msgspec
import pytest
from machine_moves import machine_moves  # noqa: F401 (autouse: each move is a row)

from conftest import Metrics
from switchyard_mw.accounts import build_accounts, pool_from_accounts
from switchyard_mw.config import parse_config
from switchyard_mw.context import RequestContext
from switchyard_mw.core.breaker import BreakerState
from switchyard_mw.core.hedge_budget import HedgeVerdict
from switchyard_mw.core.pool import Outcome
from switchyard_mw.engine.answers import deadline_exceeded
from switchyard_mw.engine.hedging import Hedging
from switchyard_mw.engine.machine import (
    NEXT,
    TIMER_SLACK_SECS,
    AskBudget,
    AttemptMachine,
    Failure,
    Phase,
    Refuse,
    Send,
    State,
)
from switchyard_mw.engine.policies import Engine
from switchyard_mw.telemetry import names as tm
from switchyard_mw.wire import Wire, read_request

CONFIG = """
[llm_clients.a]
base_url = "https://api.anthropic.com"
api_key_env = "K"
models = ["m"]
failure_threshold = 1
hedge_after_secs = 0.5
first_token_secs = 2
timeout_secs = 10

[llm_clients.b]
base_url = "https://api.anthropic.com"
api_key_env = "K"
models = ["m"]
priority = 1
failure_threshold = 1
timeout_secs = 30
"""
MESSAGES = [{"role": "user", "content": "hi"}]
JSON = msgspec.json.encode({"model": "m", "max_tokens": 8, "messages": MESSAGES})
STREAM = msgspec.json.encode({"model": "m", "max_tokens": 8, "stream": True, "messages": MESSAGES})
UNTOUCHED = (BreakerState.CLOSED, 0)
COOLED = (BreakerState.COOLED, 1)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Shared:
    """A model's hedge budget shared across replicas, answering as told."""

    def __init__(self, verdict: HedgeVerdict) -> None:
        self.verdict = verdict
        self.asked = 0
        self.noted = 0

    async def note_request(self) -> None:
        self.noted += 1

    async def try_hedge(self) -> HedgeVerdict:
        self.asked += 1
        return self.verdict


@dataclass
class Env:
    body: bytes = JSON
    ratio: float = 1.0
    hedging: bool = True
    shared: Shared | None = None
    clock: Clock = field(default_factory=Clock)
    engine: Engine = field(init=False)
    ctx: RequestContext = field(init=False)

    def __post_init__(self) -> None:
        config = parse_config(CONFIG)
        accounts = build_accounts(config, {"K": "k"})
        pool = pool_from_accounts(accounts, clock=self.clock)
        self.engine = Engine(server=config.server, accounts=accounts, pool=pool, clock=self.clock)
        shared = self.shared
        if self.hedging:
            self.engine.hedging = Hedging(
                accounts=accounts,
                max_ratio=self.ratio,
                clock=self.clock,
                shared=None if shared is None else (lambda model: shared),
            )
        self.ctx = RequestContext(read_request(Wire.ANTHROPIC, self.body), self.body, 0.0)

    def machine(self) -> AttemptMachine:
        return self.engine.machine(self.ctx)

    def started(self) -> AttemptMachine:
        """A machine whose first attempt (on a) is in flight."""
        m = self.machine()
        first = m.begin()
        assert isinstance(first, Send)
        assert first.lease.account == "a"
        return m

    def cool(self, name: str) -> None:
        lease = self.engine.pool.acquire("m", allowed={name})
        assert lease is not None
        self.engine.pool.record(lease, Outcome.FAULT)

    def counts(self) -> tuple[int, int]:
        assert self.engine.hedging is not None
        return self.engine.hedging.counts("m")

    def state_of(self, name: str) -> tuple[BreakerState, int]:
        status = self.engine.pool.status_of(name)
        return status.state, status.consecutive_faults


# --- the hedge's time ---------------------------------------------------------------------------


def test_the_hedge_is_due_at_the_account_s_hedge_time_and_the_request_counts() -> None:
    env = Env()
    m = env.started()
    assert m.hedge_due() == 0.5
    assert env.counts() == (1, 0)


def test_no_hedge_is_due_without_hedging() -> None:
    env = Env(hedging=False)
    assert env.started().hedge_due() is None


def test_no_hedge_is_due_on_an_account_that_does_not_hedge() -> None:
    env = Env()
    env.cool("a")  # b takes the request: it never hedges
    m = env.machine()
    first = m.begin()
    assert isinstance(first, Send)
    assert first.lease.account == "b"
    assert m.hedge_due() is None
    assert env.counts() == (0, 0)


def test_no_hedge_is_due_when_no_other_account_is_free_but_the_request_counts() -> None:
    """b cooled: nothing can take a hedge; the request still counts in the window (a request
    that may hedge is one the ratio is read against, as before)."""
    env = Env()
    env.cool("b")
    m = env.started()
    assert m.hedge_due() is None
    assert env.counts() == (1, 0)


# --- the budget ---------------------------------------------------------------------------------


def test_the_budget_refuses_a_hedge_it_has_not_earned_counted_once(otel_metrics: Metrics) -> None:
    """At 5 % one request earns no hedge: none starts, no lease is taken, the refusal is
    counted once, and a second ask refuses again without a second count of the request."""
    env = Env(ratio=0.05)
    refused = otel_metrics.value(tm.HEDGES, **{tm.RESPONSE_MODEL: "m", "result": "refused"})
    m = env.started()
    assert m.hedge_due() == 0.5
    assert m.hedge() is None
    assert m.tried == ["a"]
    assert m.hedge_account is None
    assert env.counts() == (1, 0)
    now = otel_metrics.value(tm.HEDGES, **{tm.RESPONSE_MODEL: "m", "result": "refused"})
    assert now == refused + 1


def test_a_hedge_the_budget_allows_is_counted_and_one_more_attempt() -> None:
    env = Env()
    m = env.started()
    assert m.hedge_due() == 0.5
    hedge = m.hedge()
    assert isinstance(hedge, Send)
    assert (hedge.lease.account, hedge.model) == ("b", "m")
    assert env.counts() == (1, 1)
    assert m.tried == ["a", "b"]
    # One hedge at most: the budget is not asked again.
    assert m.hedge() is None
    assert env.counts() == (1, 1)


def test_no_hedge_asks_the_budget_when_no_account_could_take_it() -> None:
    env = Env()
    env.cool("b")
    m = env.started()
    m.hedge_due()
    assert m.hedge() is None
    assert env.counts() == (1, 0)  # the budget counts only a hedge that can start


@pytest.mark.parametrize(
    ("verdict", "starts"), [(HedgeVerdict.START, True), (HedgeVerdict.REFUSED, False)]
)
async def test_a_shared_budget_is_an_ask_the_driver_awaits(
    verdict: HedgeVerdict, starts: bool
) -> None:
    shared = Shared(verdict)
    env = Env(shared=shared)
    m = env.started()
    assert m.hedge_due() == 0.5
    assert env.engine.hedging is not None
    await env.engine.hedging.noted()
    assert shared.noted == 1  # the request counted in the shared window too
    ask = m.hedge()
    assert isinstance(ask, AskBudget)
    assert shared.asked == 0  # nothing awaited by the machine
    allowed = await ask.ask()
    assert shared.asked == 1
    assert allowed is starts
    hedge = m.hedge_allowed(allowed)
    assert isinstance(hedge, Send) is starts
    assert m.tried == (["a", "b"] if starts else ["a"])


async def test_an_answer_that_came_while_the_budget_was_asked_starts_no_hedge() -> None:
    env = Env(shared=Shared(HedgeVerdict.START))
    m = env.started()
    m.hedge_due()
    ask = m.hedge()
    assert isinstance(ask, AskBudget)
    allowed = await ask.ask()
    m.started(200)  # the first attempt answered meanwhile
    assert m.hedge_allowed(allowed) is None
    assert m.tried == ["a"]


# --- a failed run's outcome ---------------------------------------------------------------------


@dataclass(frozen=True)
class Failed:
    hedge: bool
    """The hedge failed (else the first attempt)."""
    status: int | None
    error: type[BaseException] | None
    transport: type[BaseException] | None
    after: dict[str, tuple[BreakerState, int]]
    account: str
    """The request's attempt's account afterwards."""


FAILED = {
    "the hedge's 503": Failed(True, 503, None, None, {"a": UNTOUCHED, "b": COOLED}, "a"),
    "the hedge's connect error": Failed(
        True, None, httpx.ConnectError, None, {"a": UNTOUCHED, "b": COOLED}, "a"
    ),
    "the hedge's app error wrapping a transport error": Failed(
        True, None, ValueError, httpx.ReadError, {"a": UNTOUCHED, "b": COOLED}, "a"
    ),
    "the hedge's app bug: no outcome": Failed(
        True, None, ValueError, None, {"a": UNTOUCHED, "b": UNTOUCHED}, "a"
    ),
    "the first's 500: the hedge goes on": Failed(
        False, 500, None, None, {"a": COOLED, "b": UNTOUCHED}, "b"
    ),
    "the first returned without an answer: no_response": Failed(
        False, None, None, None, {"a": COOLED, "b": UNTOUCHED}, "b"
    ),
}


@pytest.mark.parametrize("row", FAILED.values(), ids=FAILED.keys())
def test_a_run_that_fails_in_the_race_is_classified_by_the_machine(row: Failed) -> None:
    env = Env()
    m = env.started()
    m.hedge_due()
    assert isinstance(m.hedge(), Send)
    report = RequestContext(env.ctx.view, JSON, 0.0)
    report.transport_error = row.transport
    m.race_failed(hedge=row.hedge, status=row.status, error=row.error, report=report)
    assert m.hedge_account is None
    assert env.ctx.account is not None
    assert env.ctx.account.name == row.account
    assert m.state is State.SENT  # the other goes on as the request's attempt
    m.closed()
    assert {n: env.state_of(n) for n in row.after} == row.after


# --- the first content event's deadline ---------------------------------------------------------


def test_a_stream_s_first_content_is_due_at_its_first_token_limit_from_its_send() -> None:
    env = Env(body=STREAM)
    m = env.started()
    sent = env.clock.now
    env.clock.now += 0.3  # asked later: still counted from the send
    assert m.first_content_due() == sent + 2.0


def test_without_a_first_token_limit_the_stream_s_timeout_binds() -> None:
    env = Env(body=STREAM)
    env.cool("a")
    m = env.machine()
    first = m.begin()
    assert isinstance(first, Send)
    assert first.lease.account == "b"
    assert m.first_content_due() == env.clock.now + 30.0


@pytest.mark.parametrize(("left", "due_in"), [(1.5, 1.5), (2.0, 2.0), (2.5, 2.0)])
def test_the_first_content_is_due_inside_the_caller_s_budget(left: float, due_in: float) -> None:
    env = Env(body=STREAM)
    env.ctx.budget_at = env.clock.now + left
    m = env.started()
    assert m.first_content_due() == env.clock.now + due_in


def test_nothing_to_hold_for_without_a_stream_or_an_attempt_waiting() -> None:
    env = Env()
    assert env.started().first_content_due() is None  # not a stream
    env = Env(body=STREAM)
    m = env.machine()
    assert m.first_content_due() is None  # nothing sent yet
    m.begin()
    m.started(200)
    assert m.first_content_due() is None  # the answer started: the front holds it, or not


# --- the 504 of a first content event that was late ---------------------------------------------


@pytest.mark.parametrize("past", [True, False], ids=["past the deadline", "a reset"])
def test_a_retry_of_an_answer_held_for_late_content_with_no_account_left_is_the_504(
    past: bool,
) -> None:
    """Envoy retried the attempt while its headers were held for the first content (its
    per-try timeout, or a reset): with no account left, the machine's own answer is the 504
    of phase `first_token`, whatever the attempt's failure was counted as."""
    env = Env(body=STREAM)
    m = env.started()
    m.within = {"a"}  # no other account on the routed cluster
    env.ctx.attempt_deadline_secs = 2.0
    env.clock.now += 2.0 if past else 1.0
    assert m.retried(Failure.CONNECT_ERROR, Phase.FIRST_TOKEN) is NEXT
    action = m.next()
    assert isinstance(action, Refuse)
    assert action.error == deadline_exceeded(Phase.FIRST_TOKEN)


def test_a_retry_without_a_held_answer_keeps_its_own_refusal() -> None:
    env = Env(body=STREAM)
    m = env.started()
    m.within = {"a"}
    env.ctx.attempt_deadline_secs = 2.0
    env.clock.now += 1.0
    assert m.retried(Failure.CONNECT_ERROR) is NEXT
    action = m.next()
    assert isinstance(action, Refuse)
    assert action.error.status == 502  # every attempt failed in transport


@pytest.mark.parametrize(
    ("after", "late"),
    [(2.0 - 0.0011, True), (2.0 - TIMER_SLACK_SECS, True), (2.0 - 0.0051, False), (1.0, False)],
)
def test_a_retry_at_the_deadline_less_envoy_s_timer_slack_is_the_deadline_s(
    after: float, late: bool
) -> None:
    """Envoy's per-try timer was measured firing up to 1.1 ms before this process's clock said
    the bound had passed: such a retry is still the deadline's (phase `headers`, the 504),
    not a dropped connection's (a 502)."""
    env = Env(body=STREAM)
    m = env.started()
    m.within = {"a"}
    env.ctx.attempt_deadline_secs = 2.0
    env.clock.now += after
    assert m.past_deadline() is late
    assert m.retried(Failure.CONNECT_ERROR) is NEXT
    action = m.next()
    assert isinstance(action, Refuse)
    assert action.error.status == (504 if late else 502)
    assert env.ctx.deadline_phase == (Phase.HEADERS if late else None)


def test_an_attempt_that_answered_is_past_no_deadline() -> None:
    """Only an attempt in flight that has not answered can be past its deadline: a retry
    Envoy makes after an answer (a 429's wait, however long) is no timeout's."""
    env = Env(body=STREAM)
    m = env.started()
    env.ctx.attempt_deadline_secs = 2.0
    m.started(429)
    env.clock.now += 10.0
    assert m.past_deadline() is False


def test_late_content_with_no_retry_that_can_go_now_is_the_machine_s_504() -> None:
    """The first-token filter's expiry behind Envoy: another account was free when the
    content was late, but none on the cluster the retry goes to; Envoy retries now or never,
    so the machine's answer is the first-token 504 (the front made it itself before)."""
    env = Env(body=STREAM)
    m = env.started()
    env.clock.now += 2.0
    assert m.content_late() is NEXT  # b is free
    m.within = {"a"}  # the retry's cluster: a alone, which just failed
    assert not m.fails_over()
    m.retries_over()
    action = m.next()
    assert isinstance(action, Refuse)
    assert action.error == deadline_exceeded(Phase.FIRST_TOKEN)
    assert m.state is State.DONE
    assert env.state_of("a") == COOLED  # the deadline was a's fault, counted once


@pytest.mark.parametrize(("left", "phase"), [(5.0, Phase.FIRST_TOKEN), (1.0, Phase.BUDGET)])
def test_a_late_first_token_reported_after_the_machine_s_504_is_that_504_counted_once(
    left: float, phase: Phase, otel_metrics: Metrics
) -> None:
    """Envoy's timer fires while the first-token filter's 504 is on its way (the fronts made
    a first-token 504 themselves then): the machine answers its own 504 again, counted once;
    the caller's budget's when that is what ended it."""
    env = Env(body=STREAM)
    env.cool("b")
    env.ctx.budget_at = env.clock.now + left
    m = env.started()
    before = otel_metrics.value(tm.DEADLINE_EXCEEDED, phase=phase)
    env.clock.now += 2.0
    late = m.content_late()
    assert isinstance(late, Refuse)
    assert late.error == deadline_exceeded(phase)
    assert m.expired(Phase.FIRST_TOKEN).error == late.error
    assert otel_metrics.value(tm.DEADLINE_EXCEEDED, phase=phase) == before + 1
    # An expiry of another kind is counted as ever.
    total = otel_metrics.value(tm.DEADLINE_EXCEEDED, phase="total")
    env.ctx.budget_at = None
    assert m.expired(Phase.TOTAL).error == deadline_exceeded(Phase.TOTAL)
    assert otel_metrics.value(tm.DEADLINE_EXCEEDED, phase="total") == total + 1


# --- a retry in place's wait and the budget -----------------------------------------------------


def test_a_wait_ends_inside_the_budget_only_before_its_end() -> None:
    """Both fronts' retry in place asks this (behind Envoy, of its longest jittered back-off):
    a wait that would end at the budget's end or later is not taken."""
    env = Env()
    m = env.started()
    assert m.ends_in_budget(1e9)  # no budget
    env.ctx.budget_at = env.clock.now + 2.0
    assert m.ends_in_budget(1.999)
    assert not m.ends_in_budget(2.0)
    assert not m.ends_in_budget(2.5)
