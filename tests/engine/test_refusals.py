"""What switchyard answers when nothing can serve, told apart by why the accounts are out.

An account cooling for refused credentials (401, 402, 403) does not heal by waiting: when every
account is out for that, the 503 says so and invites no long wait. An outage (5xx, deadlines,
resets) keeps the `retry-after` of the earliest recovery, and wins in a mix.
"""

from __future__ import annotations

import time

import msgspec
import pytest

from switchyard_mw.accounts import build_accounts, pool_from_accounts
from switchyard_mw.config import parse_config
from switchyard_mw.context import RequestContext
from switchyard_mw.core.pool import Outcome
from switchyard_mw.engine import answers
from switchyard_mw.engine.policies import Engine
from switchyard_mw.wire import Wire, WireError, read_request

CONFIG = """
[llm_clients.a]
base_url = "https://api.openai.com"
api_key_env = "KEY_A"
models = ["m"]
failure_threshold = 1
cooldown_secs = 30

[llm_clients.b]
base_url = "https://api.openai.com"
api_key_env = "KEY_B"
models = ["m"]
priority = 1
failure_threshold = 1
cooldown_secs = 60
"""
BODY = msgspec.json.encode({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
REFUSED_TEXT = (
    "no healthy upstream account for model 'm': the upstream refused the credentials of every "
    "account (401, 402 or 403); retrying will not help until their keys or billing are fixed"
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def engine(clock: Clock) -> Engine:
    config = parse_config(CONFIG)
    accounts = build_accounts(config, {"KEY_A": "ka", "KEY_B": "kb"})
    return Engine(
        server=config.server, accounts=accounts, pool=pool_from_accounts(accounts, clock=clock)
    )


def request() -> RequestContext:
    return RequestContext(view=read_request(Wire.OPENAI_CHAT, BODY), body=BODY)


def fail(e: Engine, account: str, status: str) -> None:
    """One attempt on `account` that ended with `status`, settled as the fronts settle it."""
    lease = e.pool.acquire("m", allowed={account})
    assert lease is not None
    e.settle(lease, Outcome.FAULT, status, "m")


def answer(e: Engine) -> tuple[WireError, dict[bytes, bytes]]:
    error, headers = e.nothing_serves(request())
    return error, dict(headers)


@pytest.mark.parametrize("status", ["401", "402", "403"])
def test_every_key_refused_is_a_503_that_says_so_and_invites_no_retry(status: str) -> None:
    clock = Clock()
    e = engine(clock)
    fail(e, "a", status)
    fail(e, "b", status)
    error, headers = answer(e)
    assert (error.status, error.error_type, error.message) == (
        503,
        answers.NO_HEALTHY_ACCOUNT,
        REFUSED_TEXT,
    )
    assert headers == {b"x-should-retry": b"false"}  # a's probe is 30 s away: no retry-after


@pytest.mark.parametrize(
    ("left", "retry_after"),
    [
        (30.0, None),
        (5.001, None),  # 6 s in whole seconds: over the bound
        (5.0, b"5"),  # exactly the bound
        (4.2, b"5"),
        (0.3, b"1"),
    ],
)
def test_refused_retry_after_is_kept_only_up_to_5_s(left: float, retry_after: bytes | None) -> None:
    clock = Clock()
    e = engine(clock)
    fail(e, "a", "401")
    fail(e, "b", "401")
    clock.now += 30.0 - left  # a's probe is due in `left` s (b's in 30 s more)
    error, headers = answer(e)
    assert error.message == REFUSED_TEXT
    if retry_after is None:
        assert headers == {b"x-should-retry": b"false"}
    else:
        assert headers == {b"retry-after": retry_after}


def test_a_refused_keys_probe_in_flight_says_retry_in_1_s() -> None:
    clock = Clock()
    e = engine(clock)
    fail(e, "a", "401")
    fail(e, "b", "401")
    clock.now += 30.0
    probe = e.pool.acquire("m")
    assert probe is not None
    assert probe.probe
    error, headers = answer(e)
    assert (error.message, headers) == (REFUSED_TEXT, {b"retry-after": b"1"})


@pytest.mark.parametrize("status", ["500", "503", "529", "deadline", "connect_error"])
def test_an_outage_keeps_the_retry_after_of_the_earliest_recovery(status: str) -> None:
    clock = Clock()
    e = engine(clock)
    fail(e, "a", status)
    fail(e, "b", status)
    clock.now += 12.5
    error, headers = answer(e)
    assert (error.status, error.error_type) == (503, answers.NO_HEALTHY_ACCOUNT)
    assert error.message == "no healthy upstream account for model 'm'"
    assert headers == {b"retry-after": b"18"}  # a: 17.5 s left, in whole seconds up


def test_in_a_mix_the_outage_decides_even_when_the_refused_key_is_due_sooner() -> None:
    clock = Clock()
    e = engine(clock)
    fail(e, "b", "503")  # b heals in 60 s
    clock.now += 20.0
    fail(e, "a", "401")  # a's probe is due in 30 s, but its key was refused
    error, headers = answer(e)
    assert (error.status, error.error_type) == (503, answers.NO_HEALTHY_ACCOUNT)
    assert error.message == (
        "no healthy upstream account for model 'm'; the credentials of some were refused"
    )
    assert headers == {b"retry-after": b"40"}


def test_a_throttle_hold_heals_too_and_keeps_its_429() -> None:
    clock = Clock()
    e = engine(clock)
    fail(e, "a", "403")
    e.pool.hold("b", "m", 12.0, wall_now=time.time())
    error, headers = answer(e)
    assert (error.status, error.error_type) == (429, answers.RATE_LIMITED)
    assert headers == {b"retry-after": b"12"}


def test_the_cause_is_that_of_the_fault_that_cooled_it() -> None:
    clock = Clock()
    e = engine(clock)
    fail(e, "a", "401")
    fail(e, "b", "401")
    clock.now += 30.0  # a's probe: this time the provider is down
    fail(e, "a", "500")
    error, headers = answer(e)
    assert error.message.endswith("; the credentials of some were refused")
    # a's outage (young: re-cooled for the same 30 s), not b's refused key, due now.
    assert headers == {b"retry-after": b"30"}
    # Probes refused again make both credential coolings once more.
    clock.now += 60.0
    fail(e, "a", "401")
    fail(e, "b", "401")
    error, headers = answer(e)
    assert (error.message, headers) == (REFUSED_TEXT, {b"x-should-retry": b"false"})


# --- refused in this request, before any account cools --------------------------------------


def test_keys_refused_in_this_request_are_the_credential_503_before_any_cooling() -> None:
    """Every account refused its key in the request (a failure_threshold of 3 cools none of
    them yet): the 503 that says so, inviting no retry, not the provider's 401."""
    config = parse_config(CONFIG.replace("failure_threshold = 1", "failure_threshold = 3"))
    accounts = build_accounts(config, {"KEY_A": "ka", "KEY_B": "kb"})
    e = Engine(server=config.server, accounts=accounts, pool=pool_from_accounts(accounts))
    error, headers = e.nothing_serves(request(), refused={"a", "b"})
    assert (error.status, error.error_type, error.message) == (
        503,
        answers.NO_HEALTHY_ACCOUNT,
        REFUSED_TEXT,
    )
    assert dict(headers) == {b"x-should-retry": b"false"}
    # One refused in the request, the other closed: the other heals now, it decides.
    error, headers = e.nothing_serves(request(), refused={"a"})
    assert error.message.endswith("; the credentials of some were refused")
    assert dict(headers) == {b"retry-after": b"1"}


def test_a_key_refused_in_the_request_and_one_cooling_for_its_key_probe_due_soon() -> None:
    clock = Clock()
    e = engine(clock)
    fail(e, "a", "401")
    clock.now += 27.0  # a's probe is due in 3 s
    error, headers = e.nothing_serves(request(), refused={"b"})
    assert error.message == REFUSED_TEXT
    assert dict(headers) == {b"retry-after": b"3"}  # the probe that may find a fixed key
