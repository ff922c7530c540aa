"""Hedged first tokens behind Envoy, the processor's part without Envoy (`extproc.hedge_tries`):
which request the route may hedge, when a new try is the hedge, which try a stream holds, the
hedge's own first-token bound, and how a try's refusal or win ends the race. The live proof
through Envoy is test_envoy_hedge_live.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from extproc_helpers import request_headers
from switchyard_mw.accounts import build_accounts
from switchyard_mw.config import parse_config
from switchyard_mw.context import RequestContext
from switchyard_mw.engine.machine import Send, State
from switchyard_mw.extproc import Policies
from switchyard_mw.extproc import hedge_tries as ht
from switchyard_mw.extproc.flights import Flight
from switchyard_mw.wire import Wire, read_request

HEDGE_SECS = 0.5


def config(*, hedge: bool = True, after: str = str(HEDGE_SECS), accounts: str = "ab") -> str:
    return f"[server]\nenvoy_hedge = {str(hedge).lower()}\nhedge_max_ratio = 1.0\n" + "".join(
        f"""
[llm_clients.{name}]
base_url = "https://prov.example"
api_key_env = "KEY"
models = ["m"]
priority = {i}
first_token_secs = {4 + i}
hedge_after_secs = {after}
envoy_cluster = "prov"
"""
        for i, name in enumerate(accounts)
    )


class Clock:
    """The machines' clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def sent(text: str, *, stream: bool = True, clock: Clock | None = None) -> tuple[Policies, Any]:
    """A request of `m` whose first attempt was sent, with its machine."""
    cfg = parse_config(text)
    policies = Policies(cfg, build_accounts(cfg, {"KEY": "k"}))
    body = json.dumps(
        {
            "model": "m",
            "max_tokens": 5,
            "stream": stream,
            "messages": [{"role": "user", "content": "x"}],
        }
    ).encode()
    ctx = RequestContext(view=read_request(Wire.ANTHROPIC, body), body=body)
    flight = Flight(ctx=ctx, policies=policies)
    machine = flight.machine = policies.machine(flight)
    if clock is not None:
        machine._clock = clock  # the budget's clock: a test's to move
    assert isinstance(machine.begin(), Send)
    return policies, machine


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
def test_a_request_on_a_hedging_account_is_armed_with_its_hedge_time(stream: bool) -> None:
    _, machine = sent(config(), stream=stream)
    hedge = ht.arm(machine)
    assert hedge is not None
    assert hedge.after_secs == HEDGE_SECS
    assert hedge.race is ht.Race.ARMED


@pytest.mark.parametrize(
    ("text", "stream"),
    [
        (config(accounts="a"), True),  # no other account to hedge on
        (config(accounts="a"), False),
        (config(after="0.5").replace("hedge_after_secs = 0.5\n", "", 1), True),  # a: none
    ],
    ids=["alone", "alone-json", "no-hedge-time"],
)
def test_what_is_not_armed(text: str, stream: bool) -> None:
    _, machine = sent(text, stream=stream)
    assert ht.arm(machine) is None


def test_the_new_try_is_the_hedge_from_half_the_hedge_time() -> None:
    clock = Clock()
    _, machine = sent(config(), clock=clock)
    hedge = ht.arm(machine)
    clock.now += HEDGE_SECS / 2 - 0.001
    assert not ht.is_hedge_try(hedge, machine)  # sooner: Envoy's retry of a reset
    clock.now += 0.001
    assert ht.is_hedge_try(hedge, machine)
    assert not ht.is_hedge_try(None, machine)


async def test_a_started_hedge_names_its_try_and_has_its_own_first_token_bound() -> None:
    clock = Clock()
    _, machine = sent(config(), clock=clock)
    hedge = ht.arm(machine)
    assert hedge is not None
    sent_at = clock.now
    clock.now += 0.3  # the hedge goes 0.3 s after the first try
    action = await ht.start(hedge, machine, 2)
    assert isinstance(action, Send)
    assert action.lease.account == "b"
    assert hedge.race is ht.Race.RACING
    assert (ht.which(hedge, 1), ht.which(hedge, 2), ht.which(hedge, None)) == (
        ht.Try.FIRST,
        ht.Try.HEDGE,
        ht.Try.FIRST,
    )
    first, own = (
        ht.content_due(hedge, machine, ht.Try.FIRST),
        ht.content_due(hedge, machine, ht.Try.HEDGE),
    )
    assert first == pytest.approx(sent_at + 4)  # a's first_token_secs, from a's send
    assert own == pytest.approx(sent_at + 0.3 + 5)  # b's, from the hedge's send


def _name(account: Any) -> str | None:
    return None if account is None else str(account.name)


async def test_each_try_goes_out_as_its_own_account_through_the_race() -> None:
    """`account_of`, what the retry filter gives the hedge and the cloud filter signs each
    try as: before the hedge, the request's; racing, each try's own (the request's context
    still names the first's); once the hedge won, the hedge's account is the request's, and a
    hedge that lost goes out as none."""
    _, machine = sent(config())
    hedge = ht.arm(machine)
    assert hedge is not None
    assert _name(ht.account_of(hedge, machine, ht.Try.FIRST)) == "a"
    assert _name(ht.account_of(None, machine, ht.Try.FIRST)) == "a"  # not on the hedge route
    await ht.start(hedge, machine, 2)
    racing = [_name(ht.account_of(hedge, machine, which)) for which in ht.Try]
    assert racing == ["a", "b", None]  # FIRST, HEDGE, VOID
    assert _name(machine.ctx.account) == "a"
    ht.won(hedge, machine, ht.Try.HEDGE)
    assert _name(ht.account_of(hedge, machine, ht.Try.HEDGE)) == "b"

    _, machine = sent(config())
    hedge = ht.arm(machine)
    assert hedge is not None
    await ht.start(hedge, machine, 2)
    ht.won(hedge, machine, ht.Try.FIRST)
    assert ht.account_of(hedge, machine, ht.Try.HEDGE) is None  # lost before it went out
    assert _name(ht.account_of(hedge, machine, ht.Try.FIRST)) == "a"


async def test_no_budget_makes_a_void_try_that_is_held(capsys: pytest.CaptureFixture[str]) -> None:
    _, machine = sent(config().replace("hedge_max_ratio = 1.0", "hedge_max_ratio = 0.0"))
    hedge = ht.arm(machine)
    assert hedge is not None
    assert await ht.start(hedge, machine, 2) is None
    assert hedge.race is ht.Race.VOID
    assert ht.which(hedge, 2) is ht.Try.VOID
    assert ht.lost_already(hedge, ht.Try.VOID)
    assert ht.content_due(hedge, machine, ht.Try.VOID) is None
    assert ht.refused(hedge, machine, ht.Try.VOID, 400)  # held: never the client's
    assert not ht.refused(hedge, machine, ht.Try.FIRST, 503)  # the attempt: the machine's
    assert machine.state is State.SENT
    assert capsys.readouterr().out == ""  # a refusal is the decision logs' to say, not stdout's


async def test_the_hedge_with_content_first_wins_and_the_first_goes_back_unblamed() -> None:
    policies, machine = sent(config())
    hedge = ht.arm(machine)
    assert hedge is not None
    await ht.start(hedge, machine, 2)
    ht.won(hedge, machine, ht.Try.HEDGE)
    assert hedge.race is ht.Race.OVER
    assert machine.ctx.account is not None
    assert machine.ctx.account.name == "b"
    assert policies.engine.pool.status_of("a").consecutive_faults == 0
    assert ht.lost_already(hedge, ht.Try.FIRST)
    assert not ht.lost_already(hedge, ht.Try.HEDGE)
    assert ht.refused(hedge, machine, ht.Try.FIRST, 503)  # the loser's late refusal: held


@pytest.mark.parametrize(
    ("which", "blamed", "account"), [(ht.Try.HEDGE, "b", "a"), (ht.Try.FIRST, "a", "b")]
)
async def test_a_try_refused_while_racing_loses_as_its_account_fault(
    which: ht.Try, blamed: str, account: str
) -> None:
    policies, machine = sent(config())
    hedge = ht.arm(machine)
    assert hedge is not None
    await ht.start(hedge, machine, 2)
    assert ht.refused(hedge, machine, which, 503)
    assert hedge.race is ht.Race.OVER
    assert policies.engine.pool.status_of(blamed).consecutive_faults == 1
    assert machine.ctx.account is not None
    assert machine.ctx.account.name == account
    other = ht.Try.FIRST if which is ht.Try.HEDGE else ht.Try.HEDGE
    assert not ht.refused(hedge, machine, other, 503)  # the survivor's: the machine's rules


@pytest.mark.parametrize(
    ("which", "status", "faults", "account"),
    [
        (ht.Try.HEDGE, 500, [0, 1], "a"),
        (ht.Try.HEDGE, 429, [0, 0], "a"),  # a throttle: no fault
        (ht.Try.FIRST, 502, [1, 0], "b"),
    ],
)
async def test_a_cloud_error_in_a_racing_try_is_its_own_and_loses_it_the_race(
    which: ht.Try, status: int, faults: list[int], account: str
) -> None:
    """A try's stream carried the cloud's own error while the two race: kept for that try
    (not the request's context, which names the first's account), and when its answer would
    go on the try loses with that status, charged to its own account."""
    policies, machine = sent(config())
    hedge = ht.arm(machine)
    assert hedge is not None
    await ht.start(hedge, machine, 2)
    ht.report(hedge, machine.ctx, ht.account_of(hedge, machine, which), which, status)
    assert machine.ctx.upstream_status is None
    other = ht.Try.FIRST if which is ht.Try.HEDGE else ht.Try.HEDGE
    assert not ht.failed_in_stream(hedge, machine, other)  # nothing kept for the other
    assert ht.failed_in_stream(hedge, machine, which)  # it lost: held until Envoy resets it
    assert (hedge.race, hedge.winner) == (ht.Race.OVER, other)
    assert [policies.engine.pool.status_of(n).consecutive_faults for n in "ab"] == faults
    assert machine.ctx.account is not None
    assert machine.ctx.account.name == account
    assert not ht.failed_in_stream(hedge, machine, which)  # judged once


async def test_a_cloud_error_outside_the_race_is_the_request_attempts() -> None:
    """Before the hedge, and in the try that is the attempt once the race is over, the
    status goes to the request's context (the machine's own rules judge it); a try that
    lost is not heard."""
    _, machine = sent(config())
    hedge = ht.arm(machine)
    assert hedge is not None
    first = ht.account_of(hedge, machine, ht.Try.FIRST)
    ht.report(hedge, machine.ctx, first, ht.Try.FIRST, 500)
    assert machine.ctx.upstream_status == 500
    assert hedge.reported == {}

    _, machine = sent(config())
    hedge = ht.arm(machine)
    assert hedge is not None
    await ht.start(hedge, machine, 2)
    theirs = ht.account_of(hedge, machine, ht.Try.HEDGE)
    ht.report(hedge, machine.ctx, theirs, ht.Try.HEDGE, 500)  # while racing: kept
    ht.won(hedge, machine, ht.Try.HEDGE)  # its first content came with the error
    assert machine.ctx.upstream_status == 500  # the attempt's now: the context's
    assert not ht.failed_in_stream(hedge, machine, ht.Try.HEDGE)
    machine.ctx.upstream_status = None
    ht.report(hedge, machine.ctx, first, ht.Try.FIRST, 503)  # the loser's
    assert machine.ctx.upstream_status is None
    assert hedge.reported == {}


@pytest.mark.parametrize(("which", "account"), [(ht.Try.HEDGE, "b"), (ht.Try.FIRST, "a")])
async def test_the_first_json_answer_wins_and_the_other_is_held(
    which: ht.Try, account: str
) -> None:
    policies, machine = sent(config(), stream=False)
    hedge = ht.arm(machine)
    assert hedge is not None
    await ht.start(hedge, machine, 2)
    assert not ht.answered(hedge, machine, which)  # its headers go on to the router
    assert (hedge.race, hedge.winner) == (ht.Race.OVER, which)
    assert machine.ctx.account is not None
    assert machine.ctx.account.name == account
    other = ht.Try.FIRST if which is ht.Try.HEDGE else ht.Try.HEDGE
    assert ht.answered(hedge, machine, other)  # the loser's answer: held until Envoy resets it
    assert not ht.answered(hedge, machine, which)
    assert [policies.engine.pool.status_of(n).consecutive_faults for n in "ab"] == [0, 0]


async def test_a_json_answer_before_the_hedge_or_beside_a_void_try_is_the_machines() -> None:
    _, machine = sent(
        config().replace("hedge_max_ratio = 1.0", "hedge_max_ratio = 0.0"), stream=False
    )
    hedge = ht.arm(machine)
    assert hedge is not None
    assert not ht.answered(hedge, machine, ht.Try.FIRST)  # no race yet: nothing settled
    assert hedge.race is ht.Race.ARMED
    await ht.start(hedge, machine, 2)
    assert ht.answered(hedge, machine, ht.Try.VOID)  # held: never the client's
    assert not ht.answered(hedge, machine, ht.Try.FIRST)
    assert hedge.race is ht.Race.VOID
    assert machine.state is State.SENT


def test_a_try_is_named_by_its_own_request_headers() -> None:
    message = request_headers(extra={"x-envoy-attempt-count": "2"})
    assert ht.attempt_of(message) == 2
    assert ht.attempt_of(request_headers()) is None
