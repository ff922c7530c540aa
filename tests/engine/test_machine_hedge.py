"""Hedged first tokens in the attempt machine, and the engine's hedge times and budget.

Sans-IO: plain events in, actions out, an injected clock. Accounts a and b serve `m` (a
preferred), v serves `m-var` (m's fallback chain); every account cools on its first fault, so
"no outcome" shows as an account still closed with no fault counted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import pytest
from machine_moves import machine_moves  # noqa: F401 (autouse: each move is a row)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conftest import Metrics
from switchyard_mw.accounts import build_accounts, pool_from_accounts
from switchyard_mw.config import Fallback, parse_config
from switchyard_mw.context import RequestContext
from switchyard_mw.core.breaker import BreakerState
from switchyard_mw.core.pool import Outcome
from switchyard_mw.engine.fallbacks import Chains
from switchyard_mw.engine.hedging import AUTO_CEILING_SECS, AUTO_MIN_SAMPLES, Hedging
from switchyard_mw.engine.machine import (
    DONE,
    FORWARD,
    AttemptMachine,
    Gone,
    How,
    MachineError,
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

[llm_clients.b]
base_url = "https://api.anthropic.com"
api_key_env = "K"
models = ["m"]
priority = 1
failure_threshold = 1
hedge_after_secs = "auto"

[llm_clients.v]
base_url = "https://api.anthropic.com"
api_key_env = "K"
models = ["m-var"]
failure_threshold = 1

[server]
hedge_max_ratio = 0.05
"""
BODY = msgspec.json.encode(
    {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
)
THINKING = msgspec.json.encode(
    {
        "model": "m",
        "max_tokens": 8,
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": [{"type": "thinking", "thinking": "t", "signature": "s"}],
            },
            {"role": "user", "content": "go on"},
        ],
    }
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Env:
    body: bytes = BODY
    ratio: float = 1.0
    """The hedge budget's ratio (one hedge a request: the race tests are not the budget's)."""
    clock: Clock = field(default_factory=Clock)
    engine: Engine = field(init=False)
    ctx: RequestContext = field(init=False)

    def __post_init__(self) -> None:
        config = parse_config(CONFIG)
        accounts = build_accounts(config, {"K": "k"})
        pool = pool_from_accounts(accounts, clock=self.clock)
        self.engine = Engine(server=config.server, accounts=accounts, pool=pool, clock=self.clock)
        self.engine.hedging = Hedging(accounts=accounts, max_ratio=self.ratio, clock=self.clock)
        self.ctx = RequestContext(read_request(Wire.ANTHROPIC, self.body), self.body, 0.0)

    def machine(self, **kw: bool) -> AttemptMachine:
        return self.engine.machine(self.ctx, **kw)

    def state_of(self, name: str) -> tuple[BreakerState, int]:
        status = self.engine.pool.status_of(name)
        return status.state, status.consecutive_faults


def hedged(env: Env, m: AttemptMachine) -> Send:
    """a's attempt is in flight with no content; the hedge goes to b."""
    first = m.begin()
    assert isinstance(first, Send)
    assert first.lease.account == "a"
    assert m.may_hedge()
    assert m.hedge_due() == 0.5  # the request counts in the budget
    hedge = m.hedge()
    assert isinstance(hedge, Send)
    return hedge


UNTOUCHED = (BreakerState.CLOSED, 0)


def test_a_hedge_goes_to_another_account_of_the_model_and_is_one_more_attempt() -> None:
    env = Env()
    m = env.machine()
    hedge = hedged(env, m)
    assert (hedge.lease.account, hedge.model) == ("b", "m")
    assert m.state is State.SENT  # neither answered yet
    assert m.tried == ["a", "b"]
    assert env.ctx.attempts == 2
    assert m.hedge_account is not None
    assert m.hedge_account.name == "b"
    assert env.ctx.account is not None
    assert env.ctx.account.name == "a"  # the request's attempt is still the first
    assert not m.may_hedge()  # one hedge at most
    assert m.hedge() is None


Over = Callable[[AttemptMachine], None]


@dataclass(frozen=True)
class Race:
    over: Over
    """How the race ended (the driver's call)."""
    result: str
    """`switchyard.hedges` result counted."""
    answers: str
    """The account whose answer the client gets."""
    after: dict[str, tuple[BreakerState, int]]
    """Each account once the answer finished."""


RACES = {
    "the hedge answers first": Race(
        lambda m: m.hedge_over(won=True),
        "won",
        "b",
        {"a": UNTOUCHED, "b": UNTOUCHED},
    ),
    "the first answers first": Race(
        lambda m: m.hedge_over(won=False),
        "lost",
        "a",
        {"a": UNTOUCHED, "b": UNTOUCHED},
    ),
    "the first fails before content, the hedge goes on": Race(
        lambda m: m.hedge_over(won=True, outcome=Outcome.FAULT, status="500"),
        "won",
        "b",
        {"a": (BreakerState.COOLED, 1), "b": UNTOUCHED},
    ),
    "the hedge fails before content, the first goes on": Race(
        lambda m: m.hedge_over(won=False, outcome=Outcome.FAULT, status="connect_error"),
        "lost",
        "a",
        {"a": UNTOUCHED, "b": (BreakerState.COOLED, 1)},
    ),
}


@pytest.mark.parametrize("race", RACES.values(), ids=RACES.keys())
def test_the_race_s_end(race: Race, otel_metrics: Metrics) -> None:
    env = Env()
    m = env.machine()
    hedged(env, m)
    before = otel_metrics.value(tm.HEDGES, **{tm.RESPONSE_MODEL: "m", "result": race.result})
    race.over(m)
    assert m.hedge_account is None
    after = otel_metrics.value(tm.HEDGES, **{tm.RESPONSE_MODEL: "m", "result": race.result})
    assert after == before + 1
    assert env.ctx.account is not None
    assert env.ctx.account.name == race.answers
    # The winner's answer then goes as any attempt's: a success for its account.
    assert m.started(200) is FORWARD
    assert m.first_content() is FORWARD
    assert m.ended(How.FINISHED) is DONE
    assert {n: env.state_of(n) for n in race.after} == race.after


def test_no_hedge_without_another_account_of_the_model() -> None:
    """b cooled: v serves m's fallback chain, but a hedge never changes the model."""
    env = Env()
    env.engine.chains = Chains({"m": Fallback(models=["m-var"])})
    lease = env.engine.pool.acquire("m", allowed={"b"})
    assert lease is not None
    env.engine.pool.record(lease, Outcome.FAULT)
    m = env.machine()
    assert isinstance(m.begin(), Send)
    assert not m.may_hedge()
    assert m.hedge() is None
    assert m.tried == ["a"]


def test_signed_thinking_hedges_on_its_own_model() -> None:
    env = Env(body=THINKING)
    env.engine.chains = Chains({"m": Fallback(models=["m-var"])})
    assert env.ctx.pinned_model
    m = env.machine()
    hedge = hedged(env, m)
    assert (hedge.lease.account, hedge.model) == ("b", "m")


def test_a_hedge_once_the_answer_started_is_the_driver_s_bug() -> None:
    env = Env()
    m = env.machine()
    assert isinstance(m.begin(), Send)
    m.started(200)
    assert not m.may_hedge()
    with pytest.raises(MachineError):
        m.hedge()


def test_a_request_that_ends_mid_race_gives_both_leases_back_without_outcome() -> None:
    env = Env()
    m = env.machine()
    hedged(env, m)
    m.closed()
    assert m.state is State.DONE
    assert m.hedge_account is None
    assert env.state_of("a") == UNTOUCHED
    assert env.state_of("b") == UNTOUCHED
    # Both leases went back: each account takes the next request again.
    again = env.machine()
    assert isinstance(again.begin(), Send)
    again.hedge_due()
    assert again.hedge() is not None


def test_both_attempts_are_in_the_span_tree(otel_spans: InMemorySpanExporter) -> None:
    env = Env()
    m = env.machine(traced=True)
    hedge = hedged(env, m)
    assert hedge.span is not None
    m.hedge_over(won=True)
    m.started(200)
    m.ended(How.FINISHED)
    attempts = [s for s in otel_spans.get_finished_spans() if s.name == tm.SPAN_ATTEMPT]
    seen = {
        (s.attributes or {})[tm.ACCOUNT]: (
            (s.attributes or {}).get(tm.ATTEMPT_STATUS),
            (s.attributes or {}).get(tm.HEDGE),
        )
        for s in attempts
    }
    assert seen == {"a": (Gone.HEDGE_LOST, None), "b": ("200", True)}
    calls = [s for s in otel_spans.get_finished_spans() if s.name.startswith("chat ")]
    assert sorted((s.attributes or {}).get(tm.ERROR_TYPE) or "" for s in calls) == [
        "",
        "hedge_lost",
    ]


# --- the engine's side: hedge times and the budget -----------------------------------------------


def test_the_budget_holds_the_ratio_when_every_request_would_hedge(otel_metrics: Metrics) -> None:
    """1,000 requests in one window, each asking to hedge: 5 % of them start one, the first
    only once 20 requests are counted (a window never owes a hedge it has not earned)."""
    env = Env(ratio=parse_config(CONFIG).server.hedge_max_ratio)
    hedging = env.engine.hedging
    assert hedging is not None
    refused = otel_metrics.value(tm.HEDGES, **{tm.RESPONSE_MODEL: "m", "result": "refused"})
    started = []
    for n in range(1, 1001):
        hedging.note_request("m")
        if hedging.try_hedge("m"):
            started.append(n)
        env.clock.now += 0.001
    assert len(started) == 50
    assert started[0] == 20
    assert started[:3] == [20, 40, 60]
    assert hedging.counts("m") == (1000, 50)
    now = otel_metrics.value(tm.HEDGES, **{tm.RESPONSE_MODEL: "m", "result": "refused"})
    assert now - refused == 950
    # Another model's budget is its own.
    hedging.note_request("other")
    assert not hedging.try_hedge("other")


def test_hedge_times_fixed_and_auto() -> None:
    env = Env()
    hedging = env.engine.hedging
    assert hedging is not None
    assert hedging.after_secs("a") == 0.5
    assert hedging.after_secs("v") is None  # off by default
    assert hedging.after_secs("b") == AUTO_CEILING_SECS  # not measured yet: hedge late
    for n in range(AUTO_MIN_SAMPLES):
        hedging.record("b", 0.1 + n * 0.1)  # 0.1 .. 2.0 s
    assert hedging.after_secs("b") == pytest.approx(1.9)  # p95 of 20: the 19th smallest
    hedging.record("a", 99.0)  # a fixed time is not measured
    assert hedging.after_secs("a") == 0.5
