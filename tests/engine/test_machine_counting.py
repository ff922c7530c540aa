"""A token count (`/v1/messages/count_tokens`) goes only to an account that can count.

Bedrock has no token count: its accounts answer one 404 without calling AWS, and a 404 is not
an account's fault, so a count that reached one would never fail over. The machine leaves
them out of a count's attempts (first, failover and hedge alike) while an account serving
the model can count; when none can, the count goes to its account, whose 404 is the answer.
Ordinary requests keep every account. Events in, actions out, as in `test_machine.py`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import pytest
from machine_moves import machine_moves  # noqa: F401 (autouse: each move is a row)

from switchyard_mw.accounts import build_accounts, pool_from_accounts
from switchyard_mw.config import parse_config
from switchyard_mw.context import RequestContext
from switchyard_mw.core.pool import Outcome
from switchyard_mw.engine.machine import (
    FORWARD,
    HOLD_FOR_FAILOVER,
    NEXT,
    AttemptMachine,
    How,
    Refuse,
    Send,
    State,
)
from switchyard_mw.engine.policies import Engine
from switchyard_mw.errors import WireError
from switchyard_mw.wire import COUNT_TOKENS_PATH, Wire, read_request

MESSAGES_PATH = "/v1/messages"
CONFIG = """
[llm_clients.aws]
kind = "bedrock"
bedrock = { region = "us-east-1" }
models = { "m" = "anthropic.m-v1:0", "solo" = "anthropic.solo-v1:0", "v" = "anthropic.v-v1:0" }
failure_threshold = 1

[llm_clients.api]
base_url = "https://api.anthropic.com"
api_key_env = "K"
models = ["m", "two"]
priority = 1
failure_threshold = 1
cooldown_secs = 30

[llm_clients.api-2]
base_url = "https://api.anthropic.com"
api_key_env = "K"
models = ["two"]
priority = 2
failure_threshold = 1

[llm_clients.aws-2]
kind = "bedrock"
bedrock = { region = "us-west-2" }
models = { "two" = "anthropic.two-v1:0" }
priority = 3

[llm_clients.gcp]
kind = "vertex"
vertex = { project = "p", region = "us-east5" }
models = { "v" = "v@20260101" }
priority = 1
"""
"""`m`: Bedrock first, the API second; `solo`: Bedrock alone; `two`: two API accounts, then
Bedrock; `v`: Bedrock first, Vertex second."""


def machine(model: str, path: str) -> AttemptMachine:
    config = parse_config(CONFIG)
    accounts = build_accounts(config, {"K": "k"})
    engine = Engine(server=config.server, accounts=accounts, pool=pool_from_accounts(accounts))
    body = msgspec.json.encode(
        {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    )
    ctx = RequestContext(read_request(Wire.ANTHROPIC, body, path), body, 0.0)
    ctx.resolved_model = model
    return engine.machine(ctx)


def fails(m: AttemptMachine, status: int = 503) -> object:
    """The attempt in flight answers `status`: the machine's next action."""
    held = m.started(status)
    if held is not HOLD_FOR_FAILOVER:
        return held
    action = m.ended(How.RETURNED, held=["held"])
    return m.next() if action is NEXT else action


@dataclass(frozen=True)
class Row:
    model: str
    path: str
    steps: Callable[[AttemptMachine], object]
    tried: list[str]
    """The accounts the request went to, in order."""
    last: State


def first(m: AttemptMachine) -> object:
    return m.begin()


def after_a_503(m: AttemptMachine) -> object:
    assert isinstance(m.begin(), Send)
    return fails(m)


def after_two_503s(m: AttemptMachine) -> object:
    assert isinstance(m.begin(), Send)
    assert isinstance(fails(m), Send)
    return fails(m)


TABLE = {
    "count: Bedrock first, the API counts": Row("m", COUNT_TOKENS_PATH, first, ["api"], State.SENT),
    "count: Bedrock first, Vertex counts": Row("v", COUNT_TOKENS_PATH, first, ["gcp"], State.SENT),
    "count: Bedrock alone answers its own 404": Row(
        "solo", COUNT_TOKENS_PATH, first, ["aws"], State.SENT
    ),
    "count: the API's 503 is the answer, never Bedrock's 404": Row(
        "m", COUNT_TOKENS_PATH, after_a_503, ["api"], State.FORWARDING
    ),
    "count: fails over from API to API, then stops short of Bedrock": Row(
        "two", COUNT_TOKENS_PATH, after_two_503s, ["api", "api-2"], State.FORWARDING
    ),
    "message: Bedrock first, as ever": Row("m", MESSAGES_PATH, first, ["aws"], State.SENT),
    "message: Bedrock's 503 fails over to the API": Row(
        "m", MESSAGES_PATH, after_a_503, ["aws", "api"], State.SENT
    ),
}


@pytest.mark.parametrize("row", TABLE.values(), ids=TABLE.keys())
def test_a_count_goes_to_an_account_that_can_count(row: Row) -> None:
    m = machine(row.model, row.path)
    action = row.steps(m)
    assert m.tried == row.tried
    assert m.state is row.last
    if row.last is State.FORWARDING:
        assert action is FORWARD  # the last failure passed on as it came


def test_bedrock_s_own_404_is_in_the_wires_shape_without_a_call() -> None:
    m = machine("solo", COUNT_TOKENS_PATH)
    send = m.begin()
    assert isinstance(send, Send)
    account = m.grounds.accounts[send.lease.account].for_model("solo")
    with pytest.raises(WireError) as info:
        asyncio.run(account.outbound(COUNT_TOKENS_PATH, m.ctx.body_for_app()))
    assert (info.value.status, info.value.error_type) == (404, "not_found_error")


def test_a_count_whose_counting_accounts_cool_waits_for_them_not_for_bedrock() -> None:
    # The API account of `m` cools for 30 s; its Bedrock account is healthy but cannot count,
    # so the 503's retry-after is the API's 30 s, not the 1 s a healthy account would say.
    m = machine("m", COUNT_TOKENS_PATH)
    pool = m.grounds.pool
    lease = pool.acquire("m", allowed={"api"})
    assert lease is not None
    pool.record(lease, Outcome.FAULT)
    action = m.begin()
    assert isinstance(action, Refuse)
    assert (action.error.status, action.error.error_type) == (503, "no_healthy_account")
    assert action.headers == ((b"retry-after", b"30"),)
    assert m.tried == []
    assert m.state is State.DONE
