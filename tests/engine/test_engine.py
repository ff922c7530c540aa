"""The engine's decisions from plain facts: no ASGI message and no ext_proc phase needed."""

from __future__ import annotations

import time

import msgspec
import pytest

from switchyard_mw.accounts import build_accounts, pool_from_accounts
from switchyard_mw.config import parse_config
from switchyard_mw.context import RequestContext
from switchyard_mw.core.pool import Outcome
from switchyard_mw.engine import answers, attempts
from switchyard_mw.engine.machine import FORWARD, HOLD_FOR_FAILOVER, How, Send
from switchyard_mw.engine.policies import Engine
from switchyard_mw.wire import Wire, read_request

CONFIG = """
[llm_clients.a]
base_url = "https://api.openai.com/v1"
api_key_env = "KEY_A"
models = ["m"]
failure_threshold = 1
cooldown_secs = 7.2
envoy_cluster = "one"

[llm_clients.b]
base_url = "https://api.openai.com/v1"
api_key_env = "KEY_B"
models = ["m"]
priority = 1
failure_threshold = 1
cooldown_secs = 7.2
"""
BODY = msgspec.json.encode({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


def engine(*, routable: frozenset[str] | None = None) -> Engine:
    config = parse_config(CONFIG)
    accounts = build_accounts(config, {"KEY_A": "ka", "KEY_B": "kb"})
    return Engine(
        server=config.server,
        accounts=accounts,
        pool=pool_from_accounts(accounts),
        routable=routable,
    )


def request() -> RequestContext:
    ctx = RequestContext(view=read_request(Wire.OPENAI_CHAT, BODY), body=BODY)
    ctx.resolved_model = "m"
    return ctx


VERDICTS = [
    # (status, finished, gone, deadline phase, upstream status) -> (outcome, status text)
    ((200, False, None, None, None), (Outcome.SUCCESS, "200")),
    ((500, False, None, None, None), (Outcome.FAULT, "500")),
    ((429, False, None, None, None), (Outcome.THROTTLE, "429")),
    ((400, False, None, None, None), (Outcome.SUCCESS, "400")),
    ((None, False, None, None, None), (Outcome.FAULT, "no_response")),
    ((200, False, "disconnected", None, None), (None, "disconnected")),
    ((200, True, "cancelled", None, None), (Outcome.SUCCESS, "200")),  # whole at the client
    ((504, False, None, "total", None), (Outcome.FAULT, "deadline")),
    ((504, False, None, "budget", None), (None, "budget")),  # the caller's, no account's
    ((502, False, None, None, 503), (Outcome.FAULT, "503")),  # what the upstream said
]


@pytest.mark.parametrize(("facts", "expected"), VERDICTS)
def test_what_an_attempt_says_about_its_account(
    facts: tuple[int | None, bool, str | None, str | None, int | None],
    expected: tuple[Outcome | None, str],
) -> None:
    status, finished, gone, phase, upstream = facts
    found = attempts.verdict(
        status, finished=finished, gone=gone, deadline_phase=phase, upstream_status=upstream
    )
    assert found == expected


def test_nothing_serves_says_503_while_cooling_429_while_held() -> None:
    e = engine()
    ctx = request()
    for _ in range(2):
        lease = e.pool.acquire("m")
        assert lease is not None
        e.pool.record(lease, Outcome.FAULT)
    error, headers = e.nothing_serves(ctx)
    assert (error.status, error.error_type) == (503, answers.NO_HEALTHY_ACCOUNT)
    assert headers == ((b"retry-after", b"8"),)  # 7.2 s, in whole seconds up
    e = engine()
    for name in ("a", "b"):
        e.pool.hold(name, "m", 3.5, wall_now=time.time())
    error, headers = e.nothing_serves(ctx)
    assert (error.status, error.error_type) == (429, answers.RATE_LIMITED)
    assert error.message == "every upstream account for model 'm' is rate limited"
    assert headers == ((b"retry-after", b"4"),)


def test_only_routable_accounts_take_requests_and_count_for_another_try() -> None:
    e = engine(routable=frozenset({"a"}))
    ctx = request()
    assert e.serving("m") == ["a"]
    machine = e.machine(ctx)
    action = machine.begin()
    assert isinstance(action, Send)
    assert action.lease.account == "a"
    # b serves m, but the front cannot reach it: a 500 is no reason to hold for another try
    assert machine.started(500) is FORWARD
    machine.ended(How.FINISHED)
    machine = engine().machine(request())
    machine.begin()
    assert machine.started(500) is HOLD_FOR_FAILOVER
    machine = engine().machine(request())
    machine.begin()
    machine.within = {"a"}  # the cluster has no other
    assert machine.started(500) is FORWARD


def test_the_attempt_deadline_and_its_504_text_per_phase() -> None:
    e = engine()
    spec = e.accounts["a"].spec
    view = request().view
    assert view is not None
    assert attempts.deadline_secs(view, spec) >= spec.timeout_secs
    for phase, text in answers.DEADLINE_TEXTS.items():
        error = answers.deadline_exceeded(phase)
        assert (error.status, error.error_type, error.message) == (504, "deadline_exceeded", text)
