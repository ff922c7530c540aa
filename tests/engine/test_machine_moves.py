"""What failed in a request, and the order of moves, where one account serves several models.

Account `a` serves `m` and `m-mini` (the chain `m` -> `m-mini`), account `b` serves `m` only
(priority 1: it is there only where a row lets it be free), `v` serves the canary variant
`m-var` and `m`. Each row plays one request: each attempt's answer, in order, and checks
where every attempt went and how the request ended.

- A failure of a pair excludes the pair for the rest of the request: the account's other
  models stay open (a fallback model or a canary's base on it is tried there).
- A refusal of the key or its billing (401, 402, 403; OpenAI's 429 `insufficient_quota`;
  Anthropic's 400 "credit balance is too low") excludes the account for every model; when
  every account that could serve refused so, the answer is the 503 that says so at once.
- The order: another account of the same model at once; then, where `retry_wait_max_secs`
  allows, the same account after its short wait; then the next model of the chain.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import pytest
from machine_moves import machine_moves  # noqa: F401 (autouse: each move is a row)

from switchyard_mw.accounts import build_accounts, pool_from_accounts
from switchyard_mw.config import Fallback, parse_config
from switchyard_mw.context import RequestContext
from switchyard_mw.core.breaker import BreakerState
from switchyard_mw.core.pool import Outcome
from switchyard_mw.core.shared import Cause
from switchyard_mw.engine.fallbacks import Chains
from switchyard_mw.engine.machine import (
    DONE,
    NEXT,
    AttemptMachine,
    Deliver,
    Failure,
    How,
    Refuse,
    Send,
    State,
    Wait,
)
from switchyard_mw.engine.policies import Engine
from switchyard_mw.wire import Wire, read_request

ACCOUNTS = """
[llm_clients.a]
base_url = "https://api.openai.com"
api_key_env = "K"
models = ["m", "m-mini"]
failure_threshold = 3
retry_wait_max_secs = {wait}

[llm_clients.b]
base_url = "https://api.openai.com"
api_key_env = "K"
models = ["m"]
priority = 1
failure_threshold = 1

[llm_clients.v]
base_url = "https://api.openai.com"
api_key_env = "K"
models = ["m-var", "m"]
priority = 2
"""
BODY = msgspec.json.encode({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
HELD = ["the held answer"]
RETRY_AFTER_1 = [(b"retry-after", b"1")]
NO_QUOTA = msgspec.json.encode(
    {
        "error": {
            "message": "You exceeded your current quota, please check your plan and billing "
            "details.",
            "type": "insufficient_quota",
            "param": None,
            "code": "insufficient_quota",
        }
    }
)
NO_CREDIT = msgspec.json.encode(
    {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "Your credit balance is too low to access the Anthropic API. Please go "
            "to Plans & Billing to upgrade or purchase credits.",
        },
    }
)
RATE_LIMITED = msgspec.json.encode(
    {"error": {"message": "Rate limit reached", "type": "requests", "code": "rate_limit_exceeded"}}
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Env:
    wait: float = 0
    clock: Clock = field(default_factory=Clock)
    engine: Engine = field(init=False)
    ctx: RequestContext = field(init=False)

    def __post_init__(self) -> None:
        config = parse_config(ACCOUNTS.format(wait=self.wait))
        accounts = build_accounts(config, {"K": "k"})
        pool = pool_from_accounts(accounts, clock=self.clock)
        chains = Chains({"m": Fallback(models=["m-mini"], on=("unavailable",))})
        self.engine = Engine(
            server=config.server, accounts=accounts, pool=pool, chains=chains, clock=self.clock
        )
        self.ctx = RequestContext(read_request(Wire.OPENAI_CHAT, BODY), BODY, self.clock.now)

    def cool(self, name: str, model: str = "m", cause: Cause = Cause.OUTAGE) -> None:
        """Other requests' faults cooled `name` for `model` (b and v: for everything)."""
        pool = self.engine.pool
        for _ in range(pool.spec_of(name).failure_threshold):
            lease = pool.acquire(model, allowed={name})
            assert lease is not None
            pool.record(lease, Outcome.FAULT, cause)


# What an attempt's upstream does: a status (its body, when the machine reads it), or a
# failure before any answer.
Answer = tuple[int, bytes, list[tuple[bytes, bytes]]] | Failure


def status(
    code: int, body: bytes = b"{}", headers: list[tuple[bytes, bytes]] | None = None
) -> Answer:
    return (code, body, headers or [])


OK = status(200)


def play(env: Env, m: AttemptMachine, answers: list[Answer]) -> tuple[list[object], object]:
    """Drive one request: each Send gets the next answer; a Wait passes on the clock. The
    attempts (Sends) and the request's last action."""
    sends: list[object] = []
    action: object = m.begin()
    pending = list(answers)
    while True:
        if isinstance(action, Wait):
            env.clock.now += action.secs
            action = m.waited()
            continue
        if not isinstance(action, Send):
            return sends, action
        sends.append(action)
        answer = pending.pop(0)
        if isinstance(answer, Failure):
            end = m.ended(How.RAISED, answer)
        else:
            code, body, headers = answer
            m.started(code, headers)
            if m.state is State.READING:
                m.read(body)
            end = m.ended(How.FINISHED if code < 400 else How.RETURNED, held=HELD)
        if end is not NEXT:
            return sends, end
        action = m.next()


def where(sends: list[object]) -> list[tuple[str, str]]:
    return [(s.lease.account, s.model) for s in sends if isinstance(s, Send)]


def credential_503(action: object) -> bool:
    return (
        isinstance(action, Refuse)
        and (action.error.status, action.error.error_type) == (503, "no_healthy_account")
        and "refused the credentials of every account" in action.error.message
        and dict(action.headers).get(b"x-should-retry") == b"false"
        and b"retry-after" not in dict(action.headers)
    )


def served(action: object) -> bool:
    """The last attempt's answer went to the client whole."""
    return action is DONE


def delivered(action: object) -> bool:
    return isinstance(action, Deliver) and action.held is HELD


@dataclass(frozen=True)
class Row:
    answers: list[Answer]
    attempts: list[tuple[str, str]]
    last: Callable[[object], bool]
    route: str | None = None
    wait: float = 0
    before: Callable[[Env], None] = lambda env: None
    model: str = "m"


def b_cooled(env: Env) -> None:
    env.cool("b")


def b_and_v_refused(env: Env) -> None:
    env.cool("b", cause=Cause.CREDENTIALS)
    env.cool("v", cause=Cause.CREDENTIALS)


def a_and_b_down(env: Env) -> None:
    env.cool("a")
    env.cool("b")


def b_and_v_down(env: Env) -> None:
    env.cool("b")
    env.cool("v")


def v_down_and_a_held_for_m_mini(env: Env) -> None:
    env.cool("v")
    env.engine.pool.hold("a", "m-mini", 30.0)


ONLY_A = b_and_v_refused
"""Of `m`'s accounts only `a` can serve (it also serves the chain's `m-mini`): b's and v's
keys were refused by earlier requests (they cool for it; waiting does not heal them)."""

FAILS_THE_PAIR: dict[str, Answer] = {
    "503": status(503),
    "529": status(529),
    "500": status(500),
    "a 429 throttle": status(429, RATE_LIMITED, RETRY_AFTER_1),
    "a 429 saying no time": status(429, RATE_LIMITED),
    "a connect error": Failure.CONNECT_ERROR,
    "a reset": Failure.TRANSPORT_ERROR,
    "a timeout": Failure.TIMEOUT,
    "a deadline": Failure.DEADLINE,
}
REFUSES_THE_KEY: dict[str, Answer] = {
    "401": status(401),
    "402": status(402),
    "403": status(403),
    "OpenAI's 429 insufficient_quota": status(429, NO_QUOTA, RETRY_AFTER_1),
    "Anthropic's 400 credit balance too low": status(400, NO_CREDIT),
}

TABLE: dict[str, Row] = {
    # The order of moves.
    "a fails m, b serves m: b at once, before the chain": Row(
        [status(503), OK], [("a", "m"), ("b", "m")], served
    ),
    "a fails m, nobody else serves m: m-mini on a (the pair failed, not the account)": Row(
        [status(529), OK],
        [("a", "m"), ("a", "m-mini")],
        served,
        route="fallback:unavailable",
        before=ONLY_A,
    ),
    "a 429 retry-after 1 on a, b free, waits allowed: b at once": Row(
        [status(429, RATE_LIMITED, RETRY_AFTER_1), OK],
        [("a", "m"), ("b", "m")],
        served,
        wait=3,
    ),
    "a 429 retry-after 1 on a alone, waits allowed: a again after 1 s, before the chain": Row(
        [status(429, RATE_LIMITED, RETRY_AFTER_1), OK],
        [("a", "m"), ("a", "m")],
        served,
        wait=3,
        before=ONLY_A,
    ),
    "a 500 once on a alone, waits allowed: a again after 0.5 s, before the chain": Row(
        [status(500), OK], [("a", "m"), ("a", "m")], served, wait=3, before=ONLY_A
    ),
    "a fails again after its wait: then the chain, on a": Row(
        [status(500), status(500), OK],
        [("a", "m"), ("a", "m"), ("a", "m-mini")],
        served,
        route="fallback:unavailable",
        wait=3,
        before=ONLY_A,
    ),
    "a 429 saying 5 s, past a's 3 s wait: the chain at once": Row(
        [status(429, RATE_LIMITED, [(b"retry-after", b"5")]), OK],
        [("a", "m"), ("a", "m-mini")],
        served,
        route="fallback:unavailable",
        wait=3,
        before=ONLY_A,
    ),
    "a 401 on a alone: no wait (a key does not heal), no chain on a: the 503": Row(
        [status(401)], [("a", "m")], credential_503, wait=3, before=ONLY_A
    ),
    # A canary's base on the account that failed the variant.
    "v fails the variant m-var: the base m on v": Row(
        [status(503), OK],
        [("v", "m-var"), ("v", "m")],
        served,
        model="m-var",
        before=a_and_b_down,
    ),
    "v refuses its key for m-var: the base m never on v": Row(
        [status(401), OK],
        [("v", "m-var"), ("a", "m")],
        served,
        model="m-var",
        before=b_cooled,
    ),
    # Every key refused: the credential 503 at once, never the provider's 401.
    "every key refused in the request: the credential 503 after one try each": Row(
        [status(401), status(401), status(403)],
        [("a", "m"), ("b", "m"), ("v", "m")],
        credential_503,
    ),
    "a refuses its key, b is down for an outage: the outage decides (503, retry-after)": Row(
        [status(401)],
        [("a", "m")],
        lambda action: (
            isinstance(action, Refuse)
            and action.error.status == 503
            and "the credentials of some were refused" in action.error.message
            and b"retry-after" in dict(action.headers)
        ),
        before=b_and_v_down,
    ),
    "a fails m with a 503, then b refuses its key: a's 503 (an answer that is no key's)": Row(
        [status(503), status(401)],
        [("a", "m"), ("b", "m")],
        delivered,
        before=v_down_and_a_held_for_m_mini,
    ),
}
for name, answer in FAILS_THE_PAIR.items():
    TABLE[f"{name} on a alone for m: the chain's m-mini on a"] = Row(
        [answer, OK],
        [("a", "m"), ("a", "m-mini")],
        served,
        route="fallback:unavailable",
        before=ONLY_A,
    )
for name, answer in REFUSES_THE_KEY.items():
    TABLE[f"{name} on a alone: never m-mini on a, the credential 503 at once"] = Row(
        [answer], [("a", "m")], credential_503, before=ONLY_A
    )
    TABLE[f"{name} on a, b serves m: b"] = Row([answer, OK], [("a", "m"), ("b", "m")], served)
    TABLE[f"{name} on a alone, waits allowed: no wait, the credential 503 at once"] = Row(
        [answer], [("a", "m")], credential_503, wait=3, before=ONLY_A
    )


@pytest.mark.parametrize("row", TABLE.values(), ids=TABLE.keys())
def test_request(row: Row) -> None:
    env = Env(wait=row.wait)
    row.before(env)
    env.ctx.resolved_model = row.model
    m = env.engine.machine(env.ctx)
    sends, last = play(env, m, row.answers)
    assert where(sends) == row.attempts
    assert row.last(last), last
    assert env.ctx.route == row.route


@pytest.mark.parametrize("name", list(REFUSES_THE_KEY))
def test_a_key_refusal_cools_the_account_for_every_model_and_holds_nothing(name: str) -> None:
    env = Env()
    ONLY_A(env)
    pool = env.engine.pool
    for _ in range(3):  # a's failure_threshold: three requests, each refused once
        m = env.engine.machine(env.ctx)
        _, last = play(env, m, [REFUSES_THE_KEY[name]])
        assert credential_503(last), last
    status = pool.status_of("a")
    assert status.state is BreakerState.COOLED
    assert status.cause is Cause.CREDENTIALS
    assert pool.holds_of("a") == {}  # a billing 429 is no throttle: no hold
    assert pool.acquire("m-mini", allowed={"a"}) is None  # cooled for its other model too


def test_a_pair_failure_leaves_the_account_s_other_model_open() -> None:
    env = Env()
    ONLY_A(env)
    pool = env.engine.pool
    for _ in range(3):  # three requests whose m failed on a: the pair cools, not a
        m = env.engine.machine(env.ctx)
        sends, _ = play(env, m, [status(503), OK])
        assert where(sends) == [("a", "m"), ("a", "m-mini")]
        env.ctx = RequestContext(read_request(Wire.OPENAI_CHAT, BODY), BODY, env.clock.now)
    assert pool.status_of("a").state is BreakerState.CLOSED
    assert pool.status_of("a", model="m").state is BreakerState.COOLED
    m = env.engine.machine(env.ctx)
    sends, _ = play(env, m, [OK])
    assert where(sends) == [("a", "m-mini")]  # the pair is cooled: the chain at once
