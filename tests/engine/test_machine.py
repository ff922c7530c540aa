"""The attempt machine's transitions, as a table: events in, actions out, no ASGI, no gRPC.

Each row drives a fresh machine to a state through plain events, takes one more event and
checks the action it answered, the state it is in, and what the account pool was told. Time
is an injected clock: the pool's (cooling) and the machine's (the caller's budget).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
import pytest
from machine_moves import machine_moves  # noqa: F401 (autouse: each move is a row)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from switchyard_mw.accounts import build_accounts, pool_from_accounts
from switchyard_mw.config import Fallback, parse_config
from switchyard_mw.context import RequestContext
from switchyard_mw.core.breaker import BreakerState
from switchyard_mw.core.pool import Outcome
from switchyard_mw.core.shared import Cause, Shared
from switchyard_mw.engine.claims import claimed
from switchyard_mw.engine.fallbacks import Chains
from switchyard_mw.engine.machine import (
    DONE,
    FORWARD,
    HOLD_FOR_FAILOVER,
    HOLD_TO_CHECK,
    NEXT,
    PASS_THROUGH,
    AttemptMachine,
    ClaimProbe,
    Deliver,
    Failure,
    Gone,
    How,
    MachineError,
    Phase,
    Refuse,
    Send,
    State,
    Wait,
)
from switchyard_mw.engine.policies import Engine
from switchyard_mw.engine.recorder import Recorder
from switchyard_mw.telemetry import names as tm
from switchyard_mw.wire import Wire, read_request

CONFIG = """
[llm_clients.a]
base_url = "https://api.anthropic.com"
api_key_env = "K"
models = ["m"]
failure_threshold = 1
cooldown_secs = 30

[llm_clients.b]
base_url = "https://api.anthropic.com"
api_key_env = "K"
models = ["m"]
priority = 1
failure_threshold = 1
cooldown_secs = 30

[llm_clients.v]
base_url = "https://api.anthropic.com"
api_key_env = "K"
models = ["m-var"]
failure_threshold = 1
cooldown_secs = 30
"""
WAIT_CONFIG = """
[llm_clients.a]
base_url = "https://api.anthropic.com"
api_key_env = "K"
models = ["m"]
failure_threshold = 2
retry_wait_max_secs = 5

[llm_clients.b]
base_url = "https://api.anthropic.com"
api_key_env = "K"
models = ["m"]
priority = 1
failure_threshold = 1
retry_wait_max_secs = 5
"""
"""Retry in place on: both accounts wait up to 5 s; `a` cools on its second fault."""
BODY = msgspec.json.encode(
    {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
)
HELD = ["the held answer"]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Store:
    """A shared store whose claims answer what the test says (`answers`, in order)."""

    def __init__(self, *answers: Shared | None) -> None:
        self.answers = list(answers)
        self.asked: list[str] = []

    def changed(
        self, account: str, change: object, local: Shared, *, model: str | None = None
    ) -> None:
        pass  # nothing is shared in these tests

    def held(self, account: str, model: str, until_unix: float) -> None:
        pass

    async def claim_probe(self, account: str, model: str | None = None) -> Shared | None:
        self.asked.append(account)
        return self.answers.pop(0)


@dataclass
class Env:
    config: str = CONFIG
    clock: Clock = field(default_factory=Clock)
    engine: Engine = field(init=False)
    ctx: RequestContext = field(init=False)

    def __post_init__(self) -> None:
        config = parse_config(self.config)
        accounts = build_accounts(config, {"K": "k"})
        pool = pool_from_accounts(accounts, clock=self.clock)
        self.engine = Engine(server=config.server, accounts=accounts, pool=pool, clock=self.clock)
        self.ctx = RequestContext(read_request(Wire.ANTHROPIC, BODY), BODY, self.clock.now)

    def machine(self, **kw: object) -> AttemptMachine:
        return self.engine.machine(self.ctx, **kw)  # type: ignore[arg-type]

    def cool(self, *names: str, model: str = "m") -> None:
        for name in names:
            lease = self.engine.pool.acquire(model, allowed={name})
            assert lease is not None
            self.engine.pool.record(lease, Outcome.FAULT)

    def state_of(self, name: str) -> BreakerState:
        return self.engine.pool.status_of(name).state

    def faults(self, name: str) -> int:
        return self.engine.pool.status_of(name).consecutive_faults


def sent(env: Env, machine: AttemptMachine) -> Send:
    action = machine.begin()
    assert isinstance(action, Send)
    return action


# --- the table ---------------------------------------------------------------------------------

Setup = Callable[[Env, AttemptMachine], object]
Step = Callable[[Env, AttemptMachine], object]
Check = Callable[[Env, AttemptMachine, object], None]


@dataclass(frozen=True)
class Row:
    setup: Setup
    """Drives the machine to the state the row starts from."""
    state: State
    """The state `setup` leaves it in."""
    event: Step
    expected: Callable[[object], bool]
    """Whether the action is the expected one."""
    after: State
    check: Check | None = None
    config: str = CONFIG


def nothing(env: Env, m: AttemptMachine) -> None:
    pass


def begun(env: Env, m: AttemptMachine) -> None:
    assert isinstance(m.begin(), Send)


def only_a(env: Env, m: AttemptMachine) -> None:
    env.cool("b")
    begun(env, m)


def only_a_app_answers_errors(env: Env, m: AttemptMachine) -> None:
    m.checks_errors = True
    only_a(env, m)


def holding(env: Env, m: AttemptMachine) -> None:
    begun(env, m)
    assert m.started(500) is HOLD_FOR_FAILOVER


def checking(env: Env, m: AttemptMachine) -> None:
    env.cool("b")
    m.checks_errors = True
    begun(env, m)
    assert m.started(502) is HOLD_TO_CHECK


def forwarding(env: Env, m: AttemptMachine) -> None:
    begun(env, m)
    assert m.started(200) is FORWARD


def first_token_expired(env: Env, m: AttemptMachine) -> None:
    """The ASGI front's deadline policy answered 504 itself: no content came in time."""
    begun(env, m)
    env.ctx.deadline_phase = Phase.FIRST_TOKEN


def first_token_held(env: Env, m: AttemptMachine) -> None:
    first_token_expired(env, m)
    assert m.started(504) is HOLD_FOR_FAILOVER


def between(env: Env, m: AttemptMachine) -> None:
    holding(env, m)
    assert m.ended(How.RETURNED, held=HELD) is NEXT


def done(env: Env, m: AttemptMachine) -> None:
    forwarding(env, m)
    assert m.ended(How.FINISHED) is DONE


def claiming(env: Env, m: AttemptMachine) -> None:
    env.cool("a", "b")
    env.clock.now += 31  # both due a probe
    env.engine.pool.attach(Store(None))  # type: ignore[arg-type]
    action = m.begin()
    assert isinstance(action, ClaimProbe)
    assert action.account == "a"


CONTEXT_REFUSAL = msgspec.json.encode(
    {
        "error": {
            "message": "too long",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    }
)
OTHER_400 = msgspec.json.encode({"error": {"message": "bad", "code": "invalid_value"}})


def chained(env: Env, m: AttemptMachine) -> None:
    """m falls back to m-var (account v) when its prompt is too long."""
    env.engine.chains = Chains({"m": Fallback(models=["m-var"], on=("context_length",))})
    begun(env, m)


def reading(env: Env, m: AttemptMachine) -> None:
    chained(env, m)
    assert m.started(400) is HOLD_FOR_FAILOVER


def read_and_ended(body: bytes) -> Step:
    def step(env: Env, m: AttemptMachine) -> object:
        m.read(body)
        return m.ended(How.RETURNED, held=HELD)

    return step


def is_send(account: str, model: str = "m") -> Callable[[object], bool]:
    return lambda a: isinstance(a, Send) and a.lease.account == account and a.model == model


def is_refuse(status: int, error_type: str) -> Callable[[object], bool]:
    return lambda a: (
        isinstance(a, Refuse) and (a.error.status, a.error.error_type) == (status, error_type)
    )


def is_(signal: object) -> Callable[[object], bool]:
    return lambda a: a is signal


def delivers(held: object) -> Callable[[object], bool]:
    return lambda a: isinstance(a, Deliver) and a.held is held


def no_model(env: Env, m: AttemptMachine) -> None:
    env.ctx.resolved_model = None


def unserved(env: Env, m: AttemptMachine) -> None:
    env.ctx.resolved_model = "nobody-serves-this"
    env.ctx.route = "judge:x"  # a judge's choice: no canary base to fall back on


def all_cooling(env: Env, m: AttemptMachine) -> None:
    env.cool("a", "b")


def all_held(env: Env, m: AttemptMachine) -> None:
    for name in ("a", "b"):
        env.engine.pool.hold(name, "m", 30.0)


def variant_cooling(env: Env, m: AttemptMachine) -> None:
    env.cool("v", model="m-var")
    env.ctx.resolved_model = "m-var"  # the canary moved it; its base is the requested "m"


def budget_spent(env: Env, m: AttemptMachine) -> None:
    begun(env, m)
    env.ctx.budget_at = env.clock.now - 0.001


def disconnected(env: Env, m: AttemptMachine) -> None:
    holding(env, m)
    env.ctx.disconnected = True


def app_reported_transport_error(env: Env, m: AttemptMachine) -> None:
    holding(env, m)
    env.ctx.report_transport_error(httpx.ConnectError("refused"))


def checking_transport_error(env: Env, m: AttemptMachine) -> None:
    checking(env, m)
    env.ctx.report_transport_error(httpx.ReadError("reset"))


def between_with_nobody_left(env: Env, m: AttemptMachine) -> None:
    between(env, m)
    env.cool("b")


def retries_over(env: Env, m: AttemptMachine) -> None:
    begun(env, m)
    m.retries_over()


def closed_while_claiming(env: Env, m: AttemptMachine) -> None:
    claiming(env, m)
    m.closed()


def a_faulted(env: Env, m: AttemptMachine, action: object) -> None:
    assert env.state_of("a") is BreakerState.COOLED


def a_untouched(env: Env, m: AttemptMachine, action: object) -> None:
    assert env.faults("a") == 0
    assert env.state_of("a") is BreakerState.CLOSED
    assert m.lease is None


def a_probe_free(env: Env, m: AttemptMachine, action: object) -> None:
    assert not env.engine.pool.status_of("a").probe_in_flight
    assert m.lease is None


def on_base_model(env: Env, m: AttemptMachine, action: object) -> None:
    assert env.ctx.resolved_model == "m"


def held_is_from_a(env: Env, m: AttemptMachine, action: object) -> None:
    assert env.ctx.account is not None
    assert env.ctx.account.name == "a"


def b_tried(env: Env, m: AttemptMachine, action: object) -> None:
    assert m.tried == ["a", "b"]
    assert env.ctx.attempts == 2


def failure_is(failure: Failure) -> Check:
    def check(env: Env, m: AttemptMachine, action: object) -> None:
        assert m.failure == failure

    return check


def phase_is(phase: Phase) -> Check:
    def check(env: Env, m: AttemptMachine, action: object) -> None:
        assert env.ctx.deadline_phase == phase
        a_faulted(env, m, action) if phase is not Phase.BUDGET else a_untouched(env, m, action)

    return check


RETRY_AFTER_2 = [(b"retry-after", b"2")]


def only_a_answers(status: int, headers: list[tuple[bytes, bytes]]) -> Setup:
    def setup(env: Env, m: AttemptMachine) -> None:
        only_a(env, m)
        assert m.started(status, headers) is HOLD_FOR_FAILOVER
        assert m.ended(How.RETURNED, held=HELD) is NEXT

    return setup


def waiting(env: Env, m: AttemptMachine) -> None:
    only_a_answers(429, RETRY_AFTER_2)(env, m)
    assert is_wait("a", 2.0)(m.next())


def retried_in_place(env: Env, m: AttemptMachine) -> None:
    waiting(env, m)
    env.clock.now += 2.0
    assert is_send("a")(m.waited())


def sent_past_its_deadline(env: Env, m: AttemptMachine) -> None:
    begun(env, m)
    secs, _ = m.deadline(env.clock.now)
    env.clock.now += secs


def b_alone_answered_503(env: Env, m: AttemptMachine) -> None:
    env.cool("a", "a")  # two faults: a cools
    assert is_send("b")(m.begin())
    assert m.started(503) is HOLD_FOR_FAILOVER  # b is not cooled yet: it may be retried
    assert m.ended(How.RETURNED, held=HELD) is NEXT  # now it is (failure_threshold = 1)


def waiting_after_a_5xx_then_a_fault(env: Env, m: AttemptMachine) -> None:
    only_a_answers(503, [])(env, m)
    assert is_wait("a", 0.5)(m.next())
    env.cool("a")  # another request's fault: its second, so it cools


def waiting_then(step: Setup) -> Setup:
    def setup(env: Env, m: AttemptMachine) -> None:
        waiting(env, m)
        step(env, m)

    return setup


def with_budget(secs: float, then: Setup) -> Setup:
    def setup(env: Env, m: AttemptMachine) -> None:
        env.ctx.budget_at = env.clock.now + secs
        then(env, m)

    return setup


def is_wait(account: str, secs: float) -> Callable[[object], bool]:
    return lambda a: isinstance(a, Wait) and (a.account, a.secs) == (account, secs)


def a_tried_twice(env: Env, m: AttemptMachine, action: object) -> None:
    assert m.tried == ["a", "a"]
    assert env.engine.pool.retry_after_secs("m", allowed={"a"}) > 0  # its hold is still on


def ask(name: str, *args: object, **kw: object) -> Step:
    return lambda env, m: getattr(m, name)(*args, **kw)


def answers(status: int, headers: list[tuple[bytes, bytes]], body: bytes = b"{}") -> Step:
    """The attempt in flight answers `status` (its body read where the machine asks): the
    machine's next action once that attempt ended (`next()`'s after `NEXT`)."""

    def step(env: Env, m: AttemptMachine) -> object:
        m.started(status, headers)
        if m.state is State.READING:
            m.read(body)
        action = m.ended(How.RETURNED, held=HELD)
        return m.next() if action is NEXT else action

    return step


TABLE: dict[str, Row] = {
    # READY
    "begin: the first account": Row(nothing, State.READY, ask("begin"), is_send("a"), State.SENT),
    "begin: no model, not ours": Row(
        no_model, State.READY, ask("begin"), is_(PASS_THROUGH), State.DONE
    ),
    "begin: nobody serves the model": Row(
        unserved, State.READY, ask("begin"), is_(PASS_THROUGH), State.DONE
    ),
    "begin: every account cooling": Row(
        all_cooling, State.READY, ask("begin"), is_refuse(503, "no_healthy_account"), State.DONE
    ),
    "begin: every account held by a 429": Row(
        all_held, State.READY, ask("begin"), is_refuse(429, "rate_limited"), State.DONE
    ),
    "begin: the canary's base takes over": Row(
        variant_cooling, State.READY, ask("begin"), is_send("a"), State.SENT, on_base_model
    ),
    # CLAIMING
    "probe claimed: ours": Row(
        claiming, State.CLAIMING, ask("probe_claimed", None), is_send("a"), State.SENT
    ),
    "probe claimed: another replica's, the next account's": Row(
        claiming,
        State.CLAIMING,
        ask(
            "probe_claimed", Shared(faults=1, period_secs=30.0, cooled_for_secs=0, probe_for_secs=5)
        ),
        lambda a: isinstance(a, ClaimProbe) and a.account == "b",
        State.CLAIMING,
    ),
    "claim abandoned: the slot goes back": Row(
        claiming, State.CLAIMING, ask("claim_abandoned"), is_(None), State.DONE, a_probe_free
    ),
    "probe claimed after the request ended: unused": Row(
        closed_while_claiming,
        State.CLAIMING,
        ask("probe_claimed", None),
        is_(DONE),
        State.DONE,
        a_probe_free,
    ),
    # SENT
    "started 200: forward": Row(
        begun, State.SENT, ask("started", 200), is_(FORWARD), State.FORWARDING
    ),
    "started 400: held to be read (a billing refusal arrives as a 400)": Row(
        begun, State.SENT, ask("started", 400), is_(HOLD_FOR_FAILOVER), State.READING
    ),
    "a 400 read, the client's own error: delivered, no other attempt": Row(
        begun, State.SENT, answers(400, [], OTHER_400), delivers(HELD), State.DONE, a_untouched
    ),
    "started 500, b free: hold for failover": Row(
        begun, State.SENT, ask("started", 500), is_(HOLD_FOR_FAILOVER), State.HOLDING
    ),
    "started 429: held to be read (a billing refusal arrives as a 429)": Row(
        begun,
        State.SENT,
        ask("started", 429, [(b"retry-after", b"7")]),
        is_(HOLD_FOR_FAILOVER),
        State.READING,
    ),
    "a 429 read, a throttle, b free: b": Row(
        begun, State.SENT, answers(429, [(b"retry-after", b"7")]), is_send("b"), State.SENT
    ),
    "started 500, nobody else: forward": Row(
        only_a, State.SENT, ask("started", 500), is_(FORWARD), State.FORWARDING
    ),
    "started 502 where the app may answer errors: hold to check": Row(
        only_a_app_answers_errors,
        State.SENT,
        ask("started", 502),
        is_(HOLD_TO_CHECK),
        State.CHECKING,
    ),
    "checked, the answer outgrows the hold: forward": Row(
        checking, State.CHECKING, ask("cannot_hold"), is_(FORWARD), State.FORWARDING
    ),
    "started 500, budget spent: forward": Row(
        budget_spent, State.SENT, ask("started", 500), is_(FORWARD), State.FORWARDING
    ),
    "started 500, retries over: forward": Row(
        retries_over, State.SENT, ask("started", 500), is_(FORWARD), State.FORWARDING
    ),
    "ended without an answer: next": Row(
        begun, State.SENT, ask("ended", How.RETURNED), is_(NEXT), State.BETWEEN, a_faulted
    ),
    "raised connect error: next": Row(
        begun,
        State.SENT,
        ask("ended", How.RAISED, Failure.CONNECT_ERROR),
        is_(NEXT),
        State.BETWEEN,
        a_faulted,
    ),
    "raised an exception type: classified": Row(
        begun,
        State.SENT,
        ask("ended", How.RAISED, error=httpx.ReadTimeout),
        is_(NEXT),
        State.BETWEEN,
        failure_is(Failure.TIMEOUT),
    ),
    "raised the app's own bug: done, no fault": Row(
        begun,
        State.SENT,
        ask("ended", How.RAISED, error=KeyError),
        is_(DONE),
        State.DONE,
        a_untouched,
    ),
    "gone: released": Row(
        begun, State.SENT, ask("ended", How.GONE), is_(DONE), State.DONE, a_untouched
    ),
    "expired: 504 with the phase": Row(
        begun,
        State.SENT,
        ask("expired", Phase.TOTAL),
        is_refuse(504, "deadline_exceeded"),
        State.DONE,
        phase_is(Phase.TOTAL),
    ),
    "expired before the first content event: 504, the account's fault": Row(
        begun,
        State.SENT,
        ask("expired", Phase.FIRST_TOKEN),
        is_refuse(504, "deadline_exceeded"),
        State.DONE,
        phase_is(Phase.FIRST_TOKEN),
    ),
    "a front's own 504 for a first-token expiry: hold for failover": Row(
        first_token_expired,
        State.SENT,
        ask("started", 504),
        is_(HOLD_FOR_FAILOVER),
        State.HOLDING,
    ),
    "first-token expiry held and returned: next, the account's fault": Row(
        first_token_held,
        State.HOLDING,
        ask("ended", How.RETURNED, held=HELD),
        is_(NEXT),
        State.BETWEEN,
        a_faulted,
    ),
    "expired on the budget: no account blamed": Row(
        begun,
        State.SENT,
        ask("expired", Phase.BUDGET),
        is_refuse(504, "deadline_exceeded"),
        State.DONE,
        phase_is(Phase.BUDGET),
    ),
    "retried by the front: released, next": Row(
        begun, State.SENT, ask("retried"), is_(NEXT), State.BETWEEN, a_untouched
    ),
    "retried by the front, never answered (a connect failure): a fault, next": Row(
        begun,
        State.SENT,
        ask("retried", Failure.CONNECT_ERROR),
        is_(NEXT),
        State.BETWEEN,
        lambda env, m, action: (
            a_faulted(env, m, action),
            failure_is(Failure.CONNECT_ERROR)(env, m, action),
        ),
    ),
    "retried by the front past the attempt's deadline (a per-try timeout): a deadline fault": Row(
        sent_past_its_deadline,
        State.SENT,
        ask("retried", Failure.CONNECT_ERROR),
        is_(NEXT),
        State.BETWEEN,
        lambda env, m, action: (
            phase_is(Phase.TOTAL)(env, m, action),
            failure_is(Failure.DEADLINE)(env, m, action),
        ),
    ),
    "retried by the front once the answer started: released as before": Row(
        holding,
        State.HOLDING,
        ask("retried", Failure.CONNECT_ERROR),
        is_(NEXT),
        State.BETWEEN,
        a_untouched,
    ),
    "closed: released": Row(begun, State.SENT, ask("closed"), is_(None), State.DONE, a_untouched),
    # HOLDING
    "held answer returned: next": Row(
        holding,
        State.HOLDING,
        ask("ended", How.RETURNED, held=HELD),
        is_(NEXT),
        State.BETWEEN,
        a_faulted,
    ),
    "held answer too large: forward": Row(
        holding, State.HOLDING, ask("cannot_hold"), is_(FORWARD), State.FORWARDING
    ),
    "held, the app reported a transport error: next": Row(
        app_reported_transport_error,
        State.HOLDING,
        ask("ended", How.RETURNED, held=HELD),
        is_(NEXT),
        State.BETWEEN,
        failure_is(Failure.CONNECT_ERROR),
    ),
    "held, the client left: deliver to nobody": Row(
        disconnected,
        State.HOLDING,
        ask("ended", How.RETURNED, held=HELD),
        delivers(HELD),
        State.DONE,
    ),
    "held, raised: the answer is dropped, next": Row(
        holding,
        State.HOLDING,
        ask("ended", How.RAISED, Failure.TRANSPORT_ERROR),
        is_(NEXT),
        State.BETWEEN,
        failure_is(Failure.TRANSPORT_ERROR),
    ),
    # CHECKING
    "checked 5xx returned: deliver it": Row(
        checking, State.CHECKING, ask("ended", How.RETURNED, held=HELD), delivers(HELD), State.DONE
    ),
    "checked 5xx was a transport error: next": Row(
        checking_transport_error,
        State.CHECKING,
        ask("ended", How.RETURNED, held=HELD),
        is_(NEXT),
        State.BETWEEN,
        failure_is(Failure.TRANSPORT_ERROR),
    ),
    # FORWARDING
    "first content: forward": Row(
        forwarding, State.FORWARDING, ask("first_content"), is_(FORWARD), State.FORWARDING
    ),
    "finished: done": Row(
        forwarding, State.FORWARDING, ask("ended", How.FINISHED), is_(DONE), State.DONE
    ),
    "returned while forwarding: done": Row(
        forwarding, State.FORWARDING, ask("ended", How.RETURNED), is_(DONE), State.DONE
    ),
    "expired slow after the answer started: the account's fault": Row(
        forwarding,
        State.FORWARDING,
        ask("expired", Phase.SLOW),
        is_refuse(504, "deadline_exceeded"),
        State.DONE,
        phase_is(Phase.SLOW),
    ),
    "raised after the answer started: done, a fault": Row(
        forwarding,
        State.FORWARDING,
        ask("ended", How.RAISED, Failure.TRANSPORT_ERROR),
        is_(DONE),
        State.DONE,
        a_faulted,
    ),
    # BETWEEN
    "next: the next account": Row(
        between, State.BETWEEN, ask("next"), is_send("b"), State.SENT, b_tried
    ),
    "next, nobody left: the held answer": Row(
        between_with_nobody_left,
        State.BETWEEN,
        ask("next"),
        delivers(HELD),
        State.DONE,
        held_is_from_a,
    ),
    "retried while between: next": Row(
        between, State.BETWEEN, ask("retried"), is_(NEXT), State.BETWEEN
    ),
    # READING
    "started 400, the model has a context_length chain: hold to read it": Row(
        chained, State.SENT, ask("started", 400), is_(HOLD_FOR_FAILOVER), State.READING
    ),
    "read a context-length refusal: next (the chain's model)": Row(
        reading, State.READING, read_and_ended(CONTEXT_REFUSAL), is_(NEXT), State.BETWEEN
    ),
    "read another 400: deliver it, no other attempt": Row(
        reading, State.READING, read_and_ended(OTHER_400), delivers(HELD), State.DONE, a_untouched
    ),
    "reading, the answer outgrows the hold: forward": Row(
        reading, State.READING, ask("cannot_hold"), is_(FORWARD), State.FORWARDING
    ),
    "reading, closed: released": Row(
        reading, State.READING, ask("closed"), is_(None), State.DONE, a_untouched
    ),
    # DONE
    "retried after the answer: next (Envoy retries on its own)": Row(
        done, State.DONE, ask("retried"), is_(NEXT), State.BETWEEN
    ),
    "expired after the answer: the 504": Row(
        done,
        State.DONE,
        ask("expired", Phase.IDLE),
        is_refuse(504, "deadline_exceeded"),
        State.DONE,
    ),
    "closed after the answer: done": Row(done, State.DONE, ask("closed"), is_(None), State.DONE),
    # Retry in place (`retry_wait_max_secs`): only when no other account can take it.
    "in place: a 429 another account can take fails over as before": Row(
        begun, State.SENT, answers(429, RETRY_AFTER_2), is_send("b"), State.SENT, config=WAIT_CONFIG
    ),
    "in place: a 429 saying 2 s, nobody else: wait to retry": Row(
        only_a,
        State.SENT,
        answers(429, RETRY_AFTER_2),
        is_wait("a", 2.0),
        State.WAITING,
        config=WAIT_CONFIG,
    ),
    "in place: a 429 saying 5 s (the max): wait to retry": Row(
        only_a,
        State.SENT,
        answers(429, [(b"retry-after-ms", b"5000")]),
        is_wait("a", 5.0),
        State.WAITING,
        config=WAIT_CONFIG,
    ),
    "in place: a 429 saying 5.001 s, past the max: delivered": Row(
        only_a,
        State.SENT,
        answers(429, [(b"retry-after-ms", b"5001")]),
        delivers(HELD),
        State.DONE,
        config=WAIT_CONFIG,
    ),
    "in place: a 429 saying no time: delivered": Row(
        only_a, State.SENT, answers(429, []), delivers(HELD), State.DONE, config=WAIT_CONFIG
    ),
    "in place: off by default (retry_wait_max_secs = 0): delivered": Row(
        only_a, State.SENT, answers(429, RETRY_AFTER_2), delivers(HELD), State.DONE
    ),
    "in place: a wait ending at the budget's end: delivered": Row(
        with_budget(2.0, only_a),
        State.SENT,
        answers(429, RETRY_AFTER_2),
        delivers(HELD),
        State.DONE,
        config=WAIT_CONFIG,
    ),
    "in place: a wait ending just inside the budget: wait": Row(
        with_budget(2.001, only_a),
        State.SENT,
        answers(429, RETRY_AFTER_2),
        is_wait("a", 2.0),
        State.WAITING,
        config=WAIT_CONFIG,
    ),
    "in place: a 5xx, nobody else, the app answers errors: held to retry, not checked": Row(
        only_a_app_answers_errors,
        State.SENT,
        ask("started", 503),
        is_(HOLD_FOR_FAILOVER),
        State.HOLDING,
        config=WAIT_CONFIG,
    ),
    "in place: a 401, b down: never retried (no wait heals a key), never the 401: 503": Row(
        only_a,
        State.SENT,
        answers(401, []),
        is_refuse(503, "no_healthy_account"),
        State.DONE,
        config=WAIT_CONFIG,
    ),
    "in place: next after a 429, nobody else: wait its retry time": Row(
        only_a_answers(429, RETRY_AFTER_2),
        State.BETWEEN,
        ask("next"),
        is_wait("a", 2.0),
        State.WAITING,
        config=WAIT_CONFIG,
    ),
    "in place: next after a 5xx with no retry time: wait 0.5 s": Row(
        only_a_answers(503, []),
        State.BETWEEN,
        ask("next"),
        is_wait("a", 0.5),
        State.WAITING,
        config=WAIT_CONFIG,
    ),
    "in place: next after a 529 saying retry-after 1: wait 1 s": Row(
        only_a_answers(529, [(b"retry-after", b"1")]),
        State.BETWEEN,
        ask("next"),
        is_wait("a", 1.0),
        State.WAITING,
        config=WAIT_CONFIG,
    ),
    "in place: next once the budget no longer fits the wait: the held answer": Row(
        with_budget(3.0, only_a_answers(429, RETRY_AFTER_2)),
        State.BETWEEN,
        lambda env, m: (setattr(env.clock, "now", env.clock.now + 1.0), m.next())[1],
        delivers(HELD),
        State.DONE,
        config=WAIT_CONFIG,
    ),
    "in place: next after a 5xx that cooled its account: the held answer at once": Row(
        b_alone_answered_503,
        State.BETWEEN,
        ask("next"),
        delivers(HELD),
        State.DONE,
        config=WAIT_CONFIG,
    ),
    "in place: waited, the hold still on by 1 ms: the same account again": Row(
        waiting_then(lambda env, m: setattr(env.clock, "now", env.clock.now + 1.999)),
        State.WAITING,
        ask("waited"),
        is_send("a"),
        State.SENT,
        a_tried_twice,
        config=WAIT_CONFIG,
    ),
    "in place: waited, but its own faults cooled it: the held answer": Row(
        waiting_after_a_5xx_then_a_fault,
        State.WAITING,
        ask("waited"),
        delivers(HELD),
        State.DONE,
        held_is_from_a,
        config=WAIT_CONFIG,
    ),
    "in place: waited after the client left: the held answer": Row(
        waiting_then(lambda env, m: setattr(env.ctx, "disconnected", True)),
        State.WAITING,
        ask("waited"),
        delivers(HELD),
        State.DONE,
        config=WAIT_CONFIG,
    ),
    "in place: expired while waiting: the 504": Row(
        waiting,
        State.WAITING,
        ask("expired", Phase.BUDGET),
        is_refuse(504, "deadline_exceeded"),
        State.DONE,
        config=WAIT_CONFIG,
    ),
    "in place: closed while waiting: done": Row(
        waiting, State.WAITING, ask("closed"), is_(None), State.DONE, config=WAIT_CONFIG
    ),
    "in place: the retry answers 429 again: delivered (once a request)": Row(
        retried_in_place,
        State.SENT,
        answers(429, RETRY_AFTER_2),
        delivers(HELD),
        State.DONE,
        config=WAIT_CONFIG,
    ),
    "in place: a stream that started and broke: never retried": Row(
        with_budget(50.0, lambda env, m: (only_a(env, m), m.started(200))),
        State.FORWARDING,
        ask("ended", How.RAISED, Failure.TRANSPORT_ERROR),
        is_(DONE),
        State.DONE,
        config=WAIT_CONFIG,
    ),
}


def b_refused(env: Env) -> None:
    """b's key was refused by earlier requests: it cools for that (no wait heals it)."""
    lease = env.engine.pool.acquire("m", allowed={"b"})
    assert lease is not None
    env.engine.pool.record(lease, Outcome.FAULT, Cause.CREDENTIALS)


def key_refused_between(env: Env, m: AttemptMachine) -> None:
    """Only a serves, and refuses its key: held, ended, no retry follows."""
    b_refused(env)
    begun(env, m)
    assert m.started(401) is HOLD_FOR_FAILOVER  # never the client's: held to be replaced
    assert m.ended(How.RETURNED) is NEXT


def key_refused_forwarded(env: Env, m: AttemptMachine) -> None:
    """Envoy's router-level stream at the final answer: no retry can follow, a 401 came."""
    b_refused(env)
    begun(env, m)
    m.retries_over()
    assert m.started(401) is FORWARD
    assert m.ended(How.RETURNED) is DONE


def key_refused_then_served(env: Env, m: AttemptMachine) -> None:
    """a refuses its key, b answers (Envoy: the final answer reaches the router-level stream,
    which asks whether to replace it)."""
    begun(env, m)
    assert m.started(401) is HOLD_FOR_FAILOVER
    assert m.ended(How.RETURNED) is NEXT
    assert is_send("b")(m.next())
    m.retries_over()
    assert m.started(200) is FORWARD
    assert m.ended(How.RETURNED) is DONE


def no_retry_invited(env: Env, m: AttemptMachine, action: object) -> None:
    assert isinstance(action, Refuse)
    assert dict(action.headers) == {b"x-should-retry": b"false"}
    assert "refused the credentials of every account" in action.error.message


def phase_set(phase: Phase) -> Check:
    def check(env: Env, m: AttemptMachine, action: object) -> None:
        assert env.ctx.deadline_phase == phase

    return check


# The events each state takes that the rows above do not start from: closing, expiring and a
# front's own retry in the held and answering states (`test_every_documented_event_has_a_row`).
TABLE.update(
    {
        "closed while claiming: the claim still reports back": Row(
            claiming, State.CLAIMING, ask("closed"), is_(None), State.CLAIMING
        ),
        "held, expired: 504, the account's fault": Row(
            holding,
            State.HOLDING,
            ask("expired", Phase.TOTAL),
            is_refuse(504, "deadline_exceeded"),
            State.DONE,
            phase_is(Phase.TOTAL),
        ),
        "held, closed: released": Row(
            holding, State.HOLDING, ask("closed"), is_(None), State.DONE, a_untouched
        ),
        "checking, expired: 504, the account's fault": Row(
            checking,
            State.CHECKING,
            ask("expired", Phase.TOTAL),
            is_refuse(504, "deadline_exceeded"),
            State.DONE,
            phase_is(Phase.TOTAL),
        ),
        "checking, retried by the front: released, next": Row(
            checking, State.CHECKING, ask("retried"), is_(NEXT), State.BETWEEN, a_untouched
        ),
        "checking, closed: released": Row(
            checking, State.CHECKING, ask("closed"), is_(None), State.DONE, a_untouched
        ),
        "reading, ended before its body was read: deliver it": Row(
            reading,
            State.READING,
            ask("ended", How.RETURNED, held=HELD),
            delivers(HELD),
            State.DONE,
            a_untouched,
        ),
        "reading, expired: 504, the account's fault": Row(
            reading,
            State.READING,
            ask("expired", Phase.TOTAL),
            is_refuse(504, "deadline_exceeded"),
            State.DONE,
            phase_is(Phase.TOTAL),
        ),
        "reading, retried by the front: released, next": Row(
            reading, State.READING, ask("retried"), is_(NEXT), State.BETWEEN, a_untouched
        ),
        "forwarding, retried by the front: released, next": Row(
            forwarding, State.FORWARDING, ask("retried"), is_(NEXT), State.BETWEEN, a_untouched
        ),
        "forwarding, closed: released": Row(
            forwarding, State.FORWARDING, ask("closed"), is_(None), State.DONE, a_untouched
        ),
        "between, expired: the 504": Row(
            between,
            State.BETWEEN,
            ask("expired", Phase.TOTAL),
            is_refuse(504, "deadline_exceeded"),
            State.DONE,
            phase_set(Phase.TOTAL),
        ),
        "between, closed: done": Row(between, State.BETWEEN, ask("closed"), is_(None), State.DONE),
        "between, no retry after a 5xx: nothing replaces the upstream answer": Row(
            between, State.BETWEEN, ask("replacement"), is_(None), State.BETWEEN
        ),
        "between, no retry after a 401 (Envoy): the credential 503 replaces it": Row(
            key_refused_between,
            State.BETWEEN,
            ask("replacement"),
            is_refuse(503, "no_healthy_account"),
            State.DONE,
            no_retry_invited,
        ),
        "done, the final answer a 401 (Envoy's last try): the credential 503 replaces it": Row(
            key_refused_forwarded,
            State.DONE,
            ask("replacement"),
            is_refuse(503, "no_healthy_account"),
            State.DONE,
            no_retry_invited,
        ),
        "done, the final answer a success: nothing replaces it": Row(
            done, State.DONE, ask("replacement"), is_(None), State.DONE
        ),
        "done, a 401 then another account's success: nothing replaces it": Row(
            key_refused_then_served, State.DONE, ask("replacement"), is_(None), State.DONE
        ),
        "a stream that broke after its content: its continuation on another account": Row(
            lambda env, m: (forwarding(env, m), m.ended(How.RAISED, Failure.TRANSPORT_ERROR)),
            State.DONE,
            ask("broke", "cut", 120, {"a", "b"}),
            is_send("b"),
            State.SENT,
            a_faulted,
        ),
    }
)


@pytest.mark.parametrize("row", TABLE.values(), ids=TABLE.keys())
def test_transition(row: Row) -> None:
    env = Env(row.config)
    machine = env.machine()
    row.setup(env, machine)
    assert machine.state is row.state
    action = row.event(env, machine)
    assert row.expected(action), action
    assert machine.state is row.after
    if row.check is not None:
        row.check(env, machine, action)


def test_every_state_and_event_is_in_the_table() -> None:
    starts = {row.state for row in TABLE.values()}
    assert starts == set(State)
    ends = {row.after for row in TABLE.values()}
    assert ends == set(State) - {State.READY}


WRONG = [
    (nothing, ["started", "ended", "next", "probe_claimed", "claim_abandoned", "first_content"]),
    (begun, ["begin", "next", "probe_claimed", "cannot_hold", "first_content", "read"]),
    (forwarding, ["started", "next", "cannot_hold", "read"]),
    (between, ["started", "ended", "cannot_hold", "waited"]),
    (done, ["begin", "started", "ended", "next", "waited"]),
    (waiting, ["begin", "started", "ended", "next", "cannot_hold", "retried", "read"]),
]


@pytest.mark.parametrize(
    ("setup", "events"), WRONG, ids=["ready", "sent", "fwd", "between", "done", "waiting"]
)
def test_an_event_out_of_place_is_the_driver_s_bug(setup: Setup, events: list[str]) -> None:
    for name in events:
        env = Env(WAIT_CONFIG if setup is waiting else CONFIG)
        machine = env.machine()
        setup(env, machine)
        before = machine.state
        args: dict[str, tuple[object, ...]] = {
            "started": (200,),
            "ended": (How.FINISHED,),
            "probe_claimed": (None,),
            "read": (b"{}",),
        }
        with pytest.raises(MachineError):
            getattr(machine, name)(*args.get(name, ()))
        assert machine.state is before


# --- whole requests ----------------------------------------------------------------------------


def test_a_429_then_a_success_holds_the_throttled_account_and_counts_one_failover() -> None:
    env = Env()
    m = env.machine()
    assert is_send("a")(m.begin())
    assert m.started(429, [(b"Retry-After", b"20")]) is HOLD_FOR_FAILOVER
    assert m.ended(How.RETURNED, held=HELD) is NEXT
    assert env.engine.pool.retry_after_secs("m", allowed={"a"}) == pytest.approx(20.0)
    assert env.state_of("a") is BreakerState.CLOSED  # a throttle never cools
    assert is_send("b")(m.next())
    assert m.started(200) is FORWARD
    assert m.ended(How.FINISHED) is DONE
    assert env.ctx.account is not None
    assert env.ctx.account.name == "b"
    assert m.tried == ["a", "b"]


def test_every_attempt_failing_in_transport_is_a_502_and_timing_out_a_504() -> None:
    for failure, status in ((Failure.CONNECT_ERROR, 502), (Failure.TIMEOUT, 504)):
        env = Env()
        m = env.machine()
        assert is_send("a")(m.begin())
        assert m.ended(How.RAISED, failure) is NEXT
        assert is_send("b")(m.next())
        assert m.ended(How.RAISED, failure) is NEXT
        action = m.next()
        assert isinstance(action, Refuse)
        assert action.error.status == status


def test_a_retry_stays_within_the_accounts_the_front_can_change_to() -> None:
    env = Env()
    m = env.machine()
    assert is_send("a")(m.begin())
    m.within = {"a"}  # behind Envoy: the routed cluster has no other account
    assert m.started(500) is FORWARD
    env2 = Env()
    m2 = env2.machine()
    assert is_send("a")(m2.begin())
    m2.within = {"a", "b"}
    assert m2.started(500) is HOLD_FOR_FAILOVER


def test_the_canary_base_is_not_a_retry_once_the_front_committed_to_a_cluster() -> None:
    env = Env()
    env.ctx.resolved_model = "m-var"
    m = env.machine()
    assert is_send("v", "m-var")(m.begin())
    assert m.started(500) is HOLD_FOR_FAILOVER  # "m" on a or b may take over
    m2 = Env().machine()
    m2.ctx.resolved_model = "m-var"
    assert is_send("v", "m-var")(m2.begin())
    m2.within = {"v"}
    assert m2.started(500) is FORWARD


def test_the_deadline_and_its_phase() -> None:
    env = Env()
    m = env.machine()
    assert is_send("a")(m.begin())
    secs, left = m.deadline(env.clock.now)
    assert secs == env.ctx.attempt_deadline_secs
    assert left is None
    assert m.phase() is Phase.TOTAL
    env.ctx.budget_at = env.clock.now + secs / 2
    _, left = m.deadline(env.clock.now)
    assert left == pytest.approx(secs / 2)
    assert m.phase() is Phase.BUDGET  # the budget bounds the attempt: its end is the caller's


def test_the_usual_first_attempt_needs_no_coroutine() -> None:
    env = Env()
    m = env.machine()
    action = m.begin()  # a plain call: no store, nothing awaited
    assert isinstance(action, Send)


async def test_claims_are_performed_by_the_driver_and_fed_back() -> None:
    env = Env()
    env.cool("a", "b")
    env.clock.now += 31
    refused = Shared(faults=1, period_secs=30.0, cooled_for_secs=0, probe_for_secs=5)
    store = Store(refused, None)
    env.engine.pool.attach(store)  # type: ignore[arg-type]
    m = env.machine()
    action = await claimed(m, m.begin())
    assert is_send("b")(action)
    assert store.asked == ["a", "b"]
    assert env.engine.pool.acquire("m", allowed={"a"}) is None  # another replica probes it


async def test_a_cancelled_claim_gives_its_slot_back() -> None:
    env = Env()
    env.cool("a", "b")
    env.clock.now += 31

    class Stuck(Store):
        async def claim_probe(self, account: str, model: str | None = None) -> Shared | None:
            await asyncio.Event().wait()
            return None

    env.engine.pool.attach(Stuck())  # type: ignore[arg-type]
    m = env.machine()
    task = asyncio.create_task(claimed(m, m.begin()))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert m.state is State.DONE
    assert not env.engine.pool.status_of("a").probe_in_flight


def test_spans_start_and_end_with_each_attempt(otel_spans: InMemorySpanExporter) -> None:
    env = Env()
    m = env.machine(traced=True)
    first = m.begin()
    assert isinstance(first, Send)
    assert first.span is not None
    m.ended(How.RAISED, Failure.CONNECT_ERROR)
    assert isinstance(m.next(), Send)
    m.started(200)
    m.ended(How.FINISHED)
    attempts = [s for s in otel_spans.get_finished_spans() if s.name == tm.SPAN_ATTEMPT]
    assert [(s.attributes or {})[tm.ACCOUNT] for s in attempts] == ["a", "b"]
    assert [(s.attributes or {})[tm.ATTEMPT_STATUS] for s in attempts] == ["connect_error", "200"]
    calls = [s for s in otel_spans.get_finished_spans() if s.name.startswith("chat ")]
    assert [(s.attributes or {}).get(tm.ERROR_TYPE) for s in calls] == ["connect_error", None]


def test_a_body_read_after_the_answer_keeps_the_spans_open_until_closed(
    otel_spans: InMemorySpanExporter,
) -> None:
    env = Env()
    m = env.machine(traced=True)
    m.begin()
    m.retries_over()
    m.started(200)
    assert m.ended(How.RETURNED, body_follows=True) is DONE
    assert not otel_spans.get_finished_spans()
    env.ctx.report_usage(input_tokens=3, output_tokens=5)
    m.closed()
    calls = [s for s in otel_spans.get_finished_spans() if s.name.startswith("chat ")]
    assert len(calls) == 1
    assert (calls[0].attributes or {})[tm.USAGE_OUTPUT_TOKENS] == 5


def test_gone_reasons_and_failures_keep_the_strings_users_see() -> None:
    assert [f.value for f in Failure] == [
        "connect_error",
        "timeout",
        "transport_error",
        "deadline",
        "no_response",
        "app_error",
    ]
    assert [p.value for p in Phase] == [
        "total",
        "headers",
        "idle",
        "budget",
        "first_token",
        "slow",
    ]
    assert Gone.DISCONNECTED == "disconnected"


def test_a_retry_in_place_is_one_more_attempt_on_the_same_account_but_no_failover(
    otel_metrics: Any,
) -> None:
    env = Env(WAIT_CONFIG)
    env.cool("b")
    failovers = otel_metrics.value(tm.FAILOVERS, **{tm.RESPONSE_MODEL: "m"})
    m = env.machine()
    assert is_send("a")(m.begin())
    assert m.started(429, RETRY_AFTER_2) is HOLD_FOR_FAILOVER
    assert m.ended(How.RETURNED, held=HELD) is NEXT
    assert m.fails_over() is False
    assert m.waits_in_place() == 2.0
    assert is_wait("a", 2.0)(m.next())
    env.clock.now += 2.0
    assert is_send("a")(m.waited())
    assert m.started(200) is FORWARD
    assert m.ended(How.FINISHED) is DONE
    assert m.tried == ["a", "a"]
    assert env.ctx.attempts == 2
    assert otel_metrics.value(tm.FAILOVERS, **{tm.RESPONSE_MODEL: "m"}) == failovers


def test_an_untraced_request_asks_nothing_of_the_recorder(monkeypatch: pytest.MonkeyPatch) -> None:
    """The usual answer with no tracing: no span, no counter, not one recorder call; a
    failover only counts itself."""
    asked: list[str] = []
    for name in ("attempt", "raised", "resumed", "settled", "ended", "lost", "failover"):
        original = getattr(Recorder, name)

        def noting(*args: object, _name: str = name, _original: Any = original) -> object:
            asked.append(_name)
            return _original(*args)

        monkeypatch.setattr(Recorder, name, staticmethod(noting))
    env = Env()
    m = env.machine()
    assert is_send("a")(m.begin())
    assert m.started(200) is FORWARD
    assert m.ended(How.FINISHED) is DONE
    m.closed()
    assert asked == []
    m = Env().machine()
    m.begin()
    m.ended(How.RAISED, Failure.CONNECT_ERROR)
    assert is_send("b")(m.next())
    assert asked == ["failover"]


def test_what_a_front_sets_on_its_engine_reaches_the_machines_it_builds() -> None:
    env = Env()
    chains = Chains({"m": Fallback(models=["m-var"])})
    env.engine.chains = chains
    env.engine.rewrites_retries = True
    assert env.engine.grounds.chains is chains
    assert env.engine.grounds.rewrites_retries is True
    assert env.machine().grounds is env.engine.grounds
