"""Fallback chains in the attempt machine: which model each attempt goes to, and why.

Two accounts (a, b) serve `m`, v serves `m-big` (m's chain, for both reasons), w serves
`m-mini` (m-big's chain, when unavailable only). Rows drive one request with plain events and
check the models and accounts of its attempts, what the client gets, and what was counted.
"""

from __future__ import annotations

import gzip
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import pytest
from machine_moves import machine_moves  # noqa: F401 (autouse: each move is a row)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conftest import Metrics
from switchyard_mw.accounts import build_accounts, pool_from_accounts
from switchyard_mw.config import parse_config
from switchyard_mw.context import RequestContext
from switchyard_mw.core.pool import Outcome
from switchyard_mw.engine.fallbacks import Chains, context_refusal
from switchyard_mw.engine.machine import (
    DONE,
    FORWARD,
    HOLD_FOR_FAILOVER,
    NEXT,
    AttemptMachine,
    Deliver,
    Failure,
    How,
    Refuse,
    Send,
    State,
)
from switchyard_mw.engine.policies import Engine
from switchyard_mw.telemetry import names as tm
from switchyard_mw.wire import Wire, read_request

ACCOUNT = """
[llm_clients.{name}]
base_url = "https://api.openai.com"
api_key_env = "K"
models = ["{model}"]
priority = {priority}
failure_threshold = 1
"""
CONFIG = "".join(
    ACCOUNT.format(name=n, model=m, priority=p)
    for n, m, p in (("a", "m", 0), ("b", "m", 1), ("v", "m-big", 0), ("w", "m-mini", 0))
) + (
    """
[fallbacks]
"m" = ["m-big"]
"m-big" = { models = ["m-mini"], on = ["unavailable"] }
"""
)
BODY = msgspec.json.encode({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
SIGNED = msgspec.json.encode(
    {
        "model": "m",
        "max_tokens": 8,
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": [{"type": "thinking", "thinking": "hm", "signature": "sig"}],
            },
            {"role": "user", "content": "and?"},
        ],
    }
)
TOO_LONG = msgspec.json.encode(
    {
        "error": {
            "message": "This model's maximum context length is 128000 tokens.",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    }
)
HELD = ["the held 400"]


@dataclass
class Env:
    body: bytes = BODY
    wire: Wire = Wire.OPENAI_CHAT
    engine: Engine = field(init=False)
    ctx: RequestContext = field(init=False)

    def __post_init__(self) -> None:
        config = parse_config(CONFIG)
        accounts = build_accounts(config, {"K": "k"})
        pool = pool_from_accounts(accounts)
        self.engine = Engine(
            server=config.server,
            accounts=accounts,
            pool=pool,
            chains=Chains(config.fallbacks),
        )
        self.ctx = RequestContext(read_request(self.wire, self.body), self.body, 0.0)

    def machine(self, **kw: object) -> AttemptMachine:
        return self.engine.machine(self.ctx, **kw)  # type: ignore[arg-type]

    def cool(self, *names: str) -> None:
        for name in names:
            model = self.engine.accounts[name].spec.models[0]
            lease = self.engine.pool.acquire(model, allowed={name})
            assert lease is not None
            self.engine.pool.record(lease, Outcome.FAULT)


def where(action: object) -> tuple[str, str]:
    assert isinstance(action, Send), action
    return action.lease.account, action.model


def refused(m: AttemptMachine) -> object:
    """The attempt in flight answers a context-length refusal."""
    assert m.started(400) is HOLD_FOR_FAILOVER
    m.read(TOO_LONG)
    return m.ended(How.RETURNED, held=HELD)


# --- a request's attempts, as a table ----------------------------------------------------------

Drive = Callable[[Env, AttemptMachine], list[object]]


def all_of_m_cooled(env: Env, m: AttemptMachine) -> list[object]:
    env.cool("a", "b")
    return [m.begin()]


def all_of_m_held_by_a_429(env: Env, m: AttemptMachine) -> list[object]:
    for name in ("a", "b"):
        env.engine.pool.hold(name, "m", 30.0)
    return [m.begin()]


def m_429_in_the_request(env: Env, m: AttemptMachine) -> list[object]:
    env.cool("b")
    first = m.begin()
    assert m.started(429, [(b"retry-after", b"20")]) is HOLD_FOR_FAILOVER
    assert m.ended(How.RETURNED, held=HELD) is NEXT
    return [first, m.next()]


def with_a_shared_store(env: Env, m: AttemptMachine) -> list[object]:
    env.cool("a", "b")
    env.engine.pool.attach(_Store())  # type: ignore[arg-type]
    return [m.begin()]


def m_fails_in_the_request(env: Env, m: AttemptMachine) -> list[object]:
    first = m.begin()
    m.ended(How.RAISED, Failure.CONNECT_ERROR)
    second = m.next()
    m.ended(How.RAISED, Failure.CONNECT_ERROR)
    return [first, second, m.next()]


def the_chain_s_chain(env: Env, m: AttemptMachine) -> list[object]:
    env.cool("a", "b", "v")
    return [m.begin()]


def the_last_account_of_m_answers_500(env: Env, m: AttemptMachine) -> list[object]:
    env.cool("b")
    first = m.begin()
    assert m.started(500) is HOLD_FOR_FAILOVER  # m-big's v can take over: worth holding
    assert m.ended(How.RETURNED, held=HELD) is NEXT
    return [first, m.next()]


def too_long_for_m(env: Env, m: AttemptMachine) -> list[object]:
    first = m.begin()
    assert refused(m) is NEXT
    return [first, m.next()]


def too_long_for_m_then_m_big(env: Env, m: AttemptMachine) -> list[object]:
    first = m.begin()
    refused(m)
    second = m.next()
    # m-big's chain is for `unavailable` only: the refusal of m-big goes to the client (read
    # first: a 400 may be a billing refusal)
    return [first, second, refused(m)]


def too_long_and_m_big_cooled(env: Env, m: AttemptMachine) -> list[object]:
    env.cool("v")
    first = m.begin()
    refused(m)
    return [first, m.next()]  # m-mini is no context_length model of m: the 400 as it came


def signed_thinking_stays(env: Env, m: AttemptMachine) -> list[object]:
    env.cool("a", "b")
    return [m.begin()]


def signed_thinking_too_long(env: Env, m: AttemptMachine) -> list[object]:
    first = m.begin()
    return [first, refused(m)]  # read (a billing refusal?), but no other model may follow


class _Store:
    """A shared store with nothing shared (the begin path that asks no fast question)."""

    def changed(self, account: str, change: object, local: object) -> None:
        pass

    def held(self, account: str, model: str, until_unix: float) -> None:
        pass

    async def claim_probe(self, account: str) -> None:
        return None


@dataclass(frozen=True)
class Row:
    drive: Drive
    attempts: list[tuple[str, str]]
    """(account, model) of each attempt."""
    route: str | None
    """`x-switchyard-route` as the request ends."""
    last: Callable[[object], bool]
    """What the last action must be."""
    body: bytes = BODY
    wire: Wire = Wire.OPENAI_CHAT


def sends(action: object) -> bool:
    return isinstance(action, Send)


def delivers_the_400(action: object) -> bool:
    return isinstance(action, Deliver) and action.held is HELD


def refuses(status: int) -> Callable[[object], bool]:
    return lambda action: isinstance(action, Refuse) and action.error.status == status


TABLE: dict[str, Row] = {
    "every account of m cooled: m-big": Row(
        all_of_m_cooled, [("v", "m-big")], "fallback:unavailable", sends
    ),
    "every account of m held by a 429's retry time: m-big": Row(
        all_of_m_held_by_a_429, [("v", "m-big")], "fallback:unavailable", sends
    ),
    "m's last account answers 429: m-big": Row(
        m_429_in_the_request, [("a", "m"), ("v", "m-big")], "fallback:unavailable", sends
    ),
    "state shared through a store: the same order": Row(
        with_a_shared_store, [("v", "m-big")], "fallback:unavailable", sends
    ),
    "both accounts of m fail in the request: m-big": Row(
        m_fails_in_the_request,
        [("a", "m"), ("b", "m"), ("v", "m-big")],
        "fallback:unavailable",
        sends,
    ),
    "m and m-big cooled: m-big's own chain, m-mini": Row(
        the_chain_s_chain, [("w", "m-mini")], "fallback:unavailable", sends
    ),
    "a 500 from m's last account is held: m-big takes over": Row(
        the_last_account_of_m_answers_500,
        [("a", "m"), ("v", "m-big")],
        "fallback:unavailable",
        sends,
    ),
    "a context-length refusal: m-big, never m's other account": Row(
        too_long_for_m, [("a", "m"), ("v", "m-big")], "fallback:context_length", sends
    ),
    "m-big refuses too, without a context_length chain: its 400": Row(
        too_long_for_m_then_m_big,
        [("a", "m"), ("v", "m-big")],
        "fallback:context_length",
        delivers_the_400,
    ),
    "a context-length refusal, m-big cooled: the 400 as it came": Row(
        too_long_and_m_big_cooled, [("a", "m")], None, delivers_the_400
    ),
    "signed thinking never changes model: 503": Row(
        signed_thinking_stays, [], None, refuses(503), SIGNED, Wire.ANTHROPIC
    ),
    "signed thinking, a context-length 400: delivered as it came": Row(
        signed_thinking_too_long, [("a", "m")], None, delivers_the_400, SIGNED, Wire.ANTHROPIC
    ),
}


@pytest.mark.parametrize("row", TABLE.values(), ids=TABLE.keys())
def test_request(row: Row) -> None:
    env = Env(body=row.body, wire=row.wire)
    m = env.machine()
    actions = row.drive(env, m)
    assert [where(a) for a in actions if isinstance(a, Send)] == row.attempts
    assert row.last(actions[-1]), actions[-1]
    assert env.ctx.route == row.route


# --- what is said about it ---------------------------------------------------------------------


def test_the_fallback_is_counted_and_on_the_attempt_span(
    otel_metrics: Metrics, otel_spans: InMemorySpanExporter
) -> None:
    labels = {tm.REQUEST_MODEL: "m", tm.RESPONSE_MODEL: "m-big", "reason": "context_length"}
    before = otel_metrics.value(tm.FALLBACKS, **labels)
    env = Env()
    m = env.machine(traced=True)
    m.begin()
    refused(m)
    assert where(m.next()) == ("v", "m-big")
    m.started(200)
    assert m.ended(How.FINISHED) is DONE
    assert otel_metrics.value(tm.FALLBACKS, **labels) == before + 1
    assert env.ctx.resolved_model == "m-big"
    spans = [s for s in otel_spans.get_finished_spans() if s.name == tm.SPAN_ATTEMPT]
    assert [(s.attributes or {}).get(tm.FALLBACK) for s in spans] == [None, "context_length"]


def test_a_400_that_is_no_context_length_refusal_goes_on_without_another_attempt() -> None:
    env = Env()
    m = env.machine()
    m.begin()
    assert m.started(400) is HOLD_FOR_FAILOVER
    m.read(msgspec.json.encode({"error": {"message": "bad", "code": "invalid_value"}}))
    assert m.ended(How.RETURNED, held=HELD).held is HELD  # type: ignore[union-attr]
    assert m.state is State.DONE
    assert m.tried == ["a"]


def test_without_a_chain_a_context_refusal_is_delivered_after_one_attempt() -> None:
    env = Env()
    env.engine.chains = None
    m = env.machine()
    m.begin()
    # Read all the same (a 400 may be a billing refusal), but no retry, on any account.
    assert delivers_the_400(refused(m))
    assert m.tried == ["a"]


def test_behind_a_cluster_the_chain_needs_a_front_that_rewrites_retries() -> None:
    for rewrites, expected in ((False, FORWARD), (True, HOLD_FOR_FAILOVER)):
        env = Env()
        env.cool("b")
        env.engine.rewrites_retries = rewrites
        m = env.machine()
        m.begin()
        m.within = {"a", "b", "v"}  # the routed cluster reaches m-big's account
        assert m.started(500) is expected


def test_behind_a_cluster_only_its_accounts_of_the_chain() -> None:
    env = Env()
    env.cool("b")
    env.engine.rewrites_retries = True
    m = env.machine()
    m.begin()
    m.within = {"a", "b"}  # m-big's v is on another cluster
    assert m.started(500) is FORWARD


# --- reading a refusal -------------------------------------------------------------------------


def anthropic(message: str, kind: str = "invalid_request_error") -> bytes:
    return msgspec.json.encode({"type": "error", "error": {"type": kind, "message": message}})


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (400, TOO_LONG, True),
        (400, anthropic("prompt is too long: 210000 tokens > 200000 maximum"), True),
        (400, anthropic("input length and `max_tokens` exceed context limit: 1 + 2 > 3"), True),
        (400, anthropic("Prompt is too long"), True),
        (400, anthropic("prompt is too long", kind="api_error"), False),
        (400, anthropic("messages: roles must alternate"), False),
        (413, TOO_LONG, False),
        (400, b"not json", False),
        (400, b"", False),
        (400, b'{"error": "context_length_exceeded"}', False),
    ],
)
def test_context_refusal(status: int, body: bytes, expected: bool) -> None:
    assert context_refusal(status, body) is expected


def test_context_refusal_gzip_and_bounds() -> None:
    assert context_refusal(400, gzip.compress(TOO_LONG))
    padded = TOO_LONG[:-1] + b"," + b'"x":"' + b"y" * 70_000 + b'"}'
    assert not context_refusal(400, padded)  # past the 64 KiB bound: not read
    assert not context_refusal(400, gzip.compress(padded))  # inflated no further either


def test_an_answer_that_reached_the_client_never_changes_model() -> None:
    env = Env()
    m = env.machine()
    m.begin()
    assert m.started(200) is FORWARD  # a stream started: the client has its first bytes
    assert m.ended(How.RAISED, Failure.TRANSPORT_ERROR) is DONE  # cut mid-way: no other model
    assert m.tried == ["a"]
    assert env.ctx.route is None


def test_a_spent_budget_moves_to_no_chain() -> None:
    env = Env()
    env.cool("b")
    env.ctx.budget_at = 10.0
    clock = [0.0]
    env.engine.grounds.clock = lambda: clock[0]
    m = env.machine()
    m.begin()
    clock[0] = 10.0  # the caller's budget ran out during the attempt
    assert m.started(500) is FORWARD
    assert m.ended(How.RETURNED) is not NEXT
    assert m.tried == ["a"]
