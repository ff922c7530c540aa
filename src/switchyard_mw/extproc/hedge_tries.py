"""Hedged first tokens behind Envoy: the route's `hedge_policy` starts the second try, the
processor gives it its account and settles the race.

With `[server] envoy_hedge`, a stream whose account hedges (`hedge_after_secs`) and whose model
another account could take (`AttemptMachine.may_hedge`) is marked `x-switchyard-hedge`, which
routes it to the route with `hedge_policy: {hedge_on_per_try_timeout: true}`, and its per-try
timeout is the hedge time. The first-token filter holds each try's headers until its first
content event, so the router sees none from a try that is slow to content: at the per-try
timeout Envoy sends a second try without cutting the first, and commits to the first try
whose headers reach it, resetting the other (measured on Envoy 1.40,
`tests/extproc/test_envoy_hedge_policy.py`).

- The second try's request headers (the upstream-level retry filter) come while the first is
  still in flight: if the budget (`hedge_max_ratio`) and an account allow, the machine's hedge
  (`AttemptMachine.hedge`) gives it that account's credential and body. Else it is a *void*
  try: it goes out with neither credential nor prompt.
- The retry filter names the try in the attempt's dynamic metadata (`switchyard.try`: `hedge`
  or `void`), which Envoy keeps per try: the first-token and refusal filters of that try read
  it back (`metadata_context`), so the processor knows which try each stream holds. (A header
  read as a CEL attribute would not do: `request.headers` is the request's, whose
  `x-envoy-attempt-count` Envoy raises for every try.)
- The try whose content comes first wins (`hedge_over(won=...)`). A try refused or past its
  first-token bound while the other races loses with what that says of its account, and is
  held (its headers never answered, `HOLD` asks Envoy for the time) until Envoy resets it for
  the other; so is a void try's refusal.

The hedged route has one retry (`num_retries: 1`), which the hedge takes: a request whose first
try fails before the hedge time has its one retry, as ever, and no hedge.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

from google.protobuf.duration_pb2 import Duration
from google.protobuf.struct_pb2 import Struct

from .._protos.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from ..engine.attempts import Phase, verdict
from ..engine.content_events import watch_for
from ..engine.machine import AttemptMachine, Send, State
from ..telemetry import names as tm

NAMESPACE = "switchyard"
"""The dynamic metadata namespace the retry filter writes and the others read."""
VOID_BODY = b""
"""The body of a try that has no account: none (cleared), which a provider refuses (a 401
without a key; a 400 for a body that is no request)."""
EARLY = 0.5
"""A second try sooner than half the hedge time is Envoy's retry of a try that never answered
(reset, refused connection), not its hedge."""
HOLD_SECS = 300
"""How long a losing try's refusal is held (`override_message_timeout`): Envoy resets the try
when the other's headers reach it. The filter's `max_message_timeout` must allow it."""
HOLD = ep.ProcessingResponse(override_message_timeout=Duration(seconds=HOLD_SECS))
"""The answer that holds a losing try's refusal: no answer to its headers, only more time.
Dropping it instead (retry-marked, with no retry left) makes Envoy 1.40 reset the try from
inside the upstream filter's callback, which crashed it (a segmentation fault, measured)."""


class Try(enum.Enum):
    """Which try of a hedged request a stream holds."""

    FIRST = "first"
    """The request's attempt before the hedge (no mark)."""
    HEDGE = "hedge"
    VOID = "void"


class Race(enum.Enum):
    """Where a hedged request's race stands."""

    ARMED = "armed"
    """Routed to the hedge route: Envoy starts a second try at the hedge time."""
    RACING = "racing"
    """The hedge has its account: both tries race for the first content event."""
    VOID = "void"
    """The second try came with no account to give it: it went out empty."""
    OVER = "over"
    """Decided: one try is the request's attempt."""


@dataclass(slots=True)
class Hedge:
    """One request's hedge under Envoy."""

    after_secs: float
    race: Race = Race.ARMED
    sent_at: float | None = None
    """When the hedge's account was given its try (monotonic)."""
    winner: Try | None = None
    """The try that is the request's attempt once the race is over."""


def arm(machine: AttemptMachine, *, enabled: bool) -> Hedge | None:
    """The request's hedge, when the route may hedge it: a stream whose content events are
    known, on an account with a hedge time, whose model another account could take now. The
    request counts in its model's hedge budget here, as a request that may hedge."""
    ctx = machine.ctx
    hedging, view, account = machine.engine.hedging, ctx.view, ctx.account
    model = ctx.resolved_model
    if not enabled or hedging is None or view is None or account is None or model is None:
        return None
    if not view.stream or watch_for(view.wire) is None:
        return None
    after = hedging.after_secs(account.name)
    if after is None:
        return None
    hedging.note_request(model)
    if not machine.may_hedge():
        return None
    return Hedge(after)


def is_hedge_try(hedge: Hedge | None, machine: AttemptMachine) -> bool:
    """Whether Envoy's new try of the request is its hedge: the route hedges, the first try is
    still in flight without an answer, no hedge has started, and the hedge time has come (a
    sooner try is Envoy's retry of a reset)."""
    sent_at = machine.sent_at()
    if hedge is None or hedge.race is not Race.ARMED or sent_at is None:
        return False
    return machine.state is State.SENT and time.monotonic() - sent_at >= hedge.after_secs * EARLY


async def start(hedge: Hedge, machine: AttemptMachine) -> Send | None:
    """The hedge try's account, when the budget and an account allow (None: a void try)."""
    hedging, model = machine.engine.hedging, machine.ctx.resolved_model
    action = None
    if (
        hedging is not None
        and model is not None
        and machine.may_hedge()
        and await hedging.may_start(model)
        and machine.state is State.SENT  # the first try answered while the budget was asked
    ):
        action = machine.hedge()
    print("START", action, flush=True)
    if action is None:
        hedge.race = Race.VOID
        return None
    hedge.race, hedge.sent_at = Race.RACING, time.monotonic()
    return action


def mark(answer: ep.ProcessingResponse, which: Try) -> ep.ProcessingResponse:
    """`answer` (to a try's request headers), naming the try in its dynamic metadata."""
    answer.dynamic_metadata.CopyFrom(_marks[which])
    return answer


def _struct(which: Try) -> Struct:
    found = Struct()
    found.update({NAMESPACE: {"try": which.value}})
    return found


_marks = {which: _struct(which) for which in Try}


def try_of(request: ep.ProcessingRequest) -> Try:
    """The try a stream's message belongs to, from its dynamic metadata (unmarked: FIRST)."""
    context = request.metadata_context.filter_metadata
    if NAMESPACE not in context:
        return Try.FIRST
    value = context[NAMESPACE].fields.get("try")
    if value is None or value.string_value == Try.FIRST.value:
        return Try.FIRST
    return Try.HEDGE if value.string_value == Try.HEDGE.value else Try.VOID


def won(hedge: Hedge, machine: AttemptMachine, which: Try) -> None:
    """The try `which` produced content first: the race is over."""
    print("WON", which, hedge, flush=True)
    if hedge.race is not Race.RACING:
        return
    hedge.race, hedge.winner = Race.OVER, which
    machine.hedge_over(won=which is Try.HEDGE)
    hedging, account = machine.engine.hedging, machine.ctx.account
    started = hedge.sent_at if which is Try.HEDGE else machine.sent_at()
    if hedging is not None and account is not None and started is not None:
        hedging.record(account.name, time.monotonic() - started)


def lost(hedge: Hedge, machine: AttemptMachine, which: Try, status: int) -> bool:
    """The try `which` failed (`status`; 504 for its first-token bound) while the other
    races: it loses with what that says of its account, and the other is the attempt. False
    when the request is not racing (the machine's own rules apply)."""
    if hedge.race is not Race.RACING or which is Try.VOID:
        return False
    hedge.race = Race.OVER
    hedge.winner = Try.FIRST if which is Try.HEDGE else Try.HEDGE
    phase = Phase.FIRST_TOKEN if status == 504 else None
    outcome, said = verdict(
        status, finished=False, gone=None, deadline_phase=phase, upstream_status=None
    )
    machine.hedge_over(won=which is not Try.HEDGE, outcome=outcome, status=said)
    if phase is not None:
        tm.deadline_exceeded.add(1, {"phase": phase})
    return True


def refused(hedge: Hedge, machine: AttemptMachine, which: Try, status: int) -> bool:
    """A try's refusal (`status`) seen by the upstream-level filter: True when it is to be
    held (`HOLD`): the void try's, a racing try's (which then loses), or a try that lost
    already; False: the machine's own rules apply (the try is the request's attempt)."""
    print("REFUSED", which, status, hedge, flush=True)
    if which is Try.VOID:
        return True
    if hedge.race is Race.OVER and hedge.winner is not None:
        return which is not hedge.winner
    return lost(hedge, machine, which, status)
