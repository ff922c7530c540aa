"""Hedged first tokens behind Envoy: the route's `hedge_policy` starts the second try, the
processor gives it its account and settles the race.

With `[server] envoy_hedge`, a stream or a JSON request whose account hedges
(`hedge_after_secs`) and whose model another account could take (`AttemptMachine.may_hedge`)
is marked `x-switchyard-hedge`, which routes it to the route with `hedge_policy:
{hedge_on_per_try_timeout: true}`, and its per-try timeout is the hedge time. The first-token
filter holds each try's headers until its first content event, so the router sees none from a
try that is slow to content: at the per-try timeout Envoy sends a second try without cutting
the first, and commits to the first try whose headers reach it, resetting the other (measured
on Envoy 1.40, `tests/extproc/test_envoy_hedge_policy.py`). A JSON answer's content is the
answer itself: its headers come when it is ready, so a try slow to answer sends none by the
per-try timeout, and the hedged refusal filter, which sees each try's 2xx JSON headers too,
settles the race at them (`answered`).

- The second try's request headers (the upstream-level retry filter) come while the first is
  still in flight: if the budget (`hedge_max_ratio`) and an account allow, the machine's hedge
  (`AttemptMachine.hedge`) gives it that account's credential and body. Else it is a *void*
  try: it goes out with neither credential nor prompt.
- Each try's first-token and refusal streams name their try by its own
  `x-envoy-attempt-count`, which they read from the try's request headers (the hedged variants
  of those filters, which the example's envoy.yaml runs only for a request marked
  `x-switchyard-hedge`, send them). Nothing read later would do: Envoy sends one header map
  for every try and raises its count for each (measured,
  `tests/extproc/test_envoy_hedge_policy.py`), and the dynamic metadata one try's filter sets
  is read back by the other's (measured with a prototype that named tries so).
- The try whose content comes first wins (`hedge_over(won=...)`): a stream's first content
  event, a JSON answer's successful headers. A try refused, past its first-token bound or
  whose stream carried the cloud's own error before content (the cloud filter keeps its
  status for that try: `report`) while the other races loses with what that says of its
  account, and is
  held (its headers never answered, `HOLD` asks Envoy for the time) until Envoy resets it for
  the other; so is a void try's refusal.

The hedged route has one retry (`num_retries: 1`), which the hedge takes: a request whose first
try fails before the hedge time has its one retry, as ever, and no hedge.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from google.protobuf.duration_pb2 import Duration

from .._protos.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from ..accounts import Account
from ..context import RequestContext
from ..engine.machine import AskBudget, AttemptMachine, Send, State

ATTEMPT_HEADER = "x-envoy-attempt-count"
VOID_BODY = b""
"""The body of a try that has no account: none (cleared), which a provider refuses (a 401
without a key; a 400 for a body that is no request)."""
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
    hedge_try: int | None = None
    """Envoy's number of the hedge's try (or of the void try)."""
    winner: Try | None = None
    """The try that is the request's attempt once the race is over."""
    reported: dict[Try, int] = field(default_factory=dict)
    """The status a racing try's own stream stood for (a cloud's error inside it, `report`),
    kept for that try: the request's context names the first try's account while they race."""


def arm(machine: AttemptMachine) -> Hedge | None:
    """The request's hedge (`[server] envoy_hedge` on), when the route may hedge it: a stream
    or a JSON request whose account hedges and whose model another account could take now
    (`AttemptMachine.hedge_due`, which counts the request in its model's hedge budget)."""
    after = machine.hedge_due()
    return None if after is None else Hedge(after)


def is_hedge_try(hedge: Hedge | None, machine: AttemptMachine) -> bool:
    """Whether Envoy's new try of the request is its hedge (the machine's word:
    `AttemptMachine.new_try_is_hedge`), on a request the route may hedge."""
    return (
        hedge is not None
        and hedge.race is Race.ARMED
        and machine.new_try_is_hedge(hedge.after_secs)
    )


async def start(hedge: Hedge, machine: AttemptMachine, attempt: int | None) -> Send | None:
    """The hedge try's account, when the budget and an account allow (None: a void try);
    `attempt`: Envoy's number of that try."""
    hedge.hedge_try = attempt
    action = machine.hedge() if machine.state is State.SENT else None
    if isinstance(action, AskBudget):  # the budget shared across replicas
        action = machine.hedge_allowed(await action.ask())
    if action is None:
        hedge.race = Race.VOID
        return None
    hedge.race = Race.RACING
    return action


def attempt_of(request: ep.ProcessingRequest) -> int | None:
    """Envoy's number of the try whose request headers `request` carries."""
    for header in request.request_headers.headers.headers:
        if header.key == ATTEMPT_HEADER:
            value = header.raw_value or header.value.encode()
            return int(value) if value.isdigit() else None
    return None


def which(hedge: Hedge | None, attempt: int | None) -> Try:
    """Which try of its request the stream of try `attempt` holds."""
    if hedge is None or attempt is None or attempt != hedge.hedge_try:
        return Try.FIRST
    return Try.VOID if hedge.race is Race.VOID else Try.HEDGE


def account_of(hedge: Hedge | None, machine: AttemptMachine, which: Try) -> Account | None:
    """The account try `which` of the request goes out as: the hedge's while it races (the
    request's context goes on naming the first try's account until the hedge wins), none for
    the void try or a hedge that lost already, else the request's attempt's (the first
    try's, or a retry's once the machine gave it its account). The retry filter gives the
    hedge its credential and body by it, the cloud filter its envelope and signature."""
    if which is Try.VOID or hedge is None:
        return None if which is Try.VOID else machine.ctx.account
    if which is Try.HEDGE and hedge.race is Race.RACING:
        return machine.hedge_account
    if which is Try.HEDGE and hedge.winner is not Try.HEDGE:
        return None
    return machine.ctx.account


def lost_already(hedge: Hedge, which: Try) -> bool:
    """Whether the try `which` lost its request's race (or is its void try)."""
    if which is Try.VOID:
        return True
    return hedge.race is Race.OVER and hedge.winner not in (None, which)


def content_due(hedge: Hedge | None, machine: AttemptMachine, which: Try) -> float | None:
    """When the try `which`'s first content event is due (the machine's word): the attempt's,
    the hedge's from its own send; none for a try that lost or is void."""
    if which is Try.VOID:
        return None
    return machine.first_content_due(hedge=hedge is not None and which is Try.HEDGE)


def won(hedge: Hedge, machine: AttemptMachine, which: Try) -> None:
    """The try `which` produced content first: the race is over."""
    if hedge.race is not Race.RACING:
        return
    hedge.race, hedge.winner = Race.OVER, which
    machine.hedge_over(won=which is Try.HEDGE)
    kept = hedge.reported.pop(which, None)
    if kept is not None:  # its stream's error came with its first content: the attempt's now
        machine.ctx.report_upstream(kept)
    # The winner is the attempt in flight now: its account, and the time since its send.
    account, secs = machine.ctx.account, machine.since_sent()
    if account is not None and secs is not None:
        machine.content_after(account.name, secs)


def lost(hedge: Hedge, machine: AttemptMachine, which: Try, status: int) -> bool:
    """The try `which` failed (`status`; 504 past its first-token bound) while the other
    races: it loses with what the machine makes of that, and the other is the attempt. False
    when the request is not racing (the machine's own rules apply)."""
    if hedge.race is not Race.RACING or which is Try.VOID:
        return False
    hedge.race = Race.OVER
    hedge.winner = Try.FIRST if which is Try.HEDGE else Try.HEDGE
    machine.race_failed(hedge=which is Try.HEDGE, status=status, error=None, report=machine.ctx)
    return True


def answered(hedge: Hedge, machine: AttemptMachine, which: Try) -> bool:
    """A try's successful answer seen at its headers by the upstream-level filter (a JSON
    answer: its content is the answer itself, and no first-token filter holds it): the first
    such try of a racing request wins. True when it is to be held (`HOLD`): a try that lost
    already, or the void try; False: it goes on to the router, which commits to it."""
    if lost_already(hedge, which):
        return True
    won(hedge, machine, which)
    return False


def report(
    hedge: Hedge | None, ctx: RequestContext, account: Account | None, which: Try, status: int
) -> None:
    """Try `which` (on `account`) carried the cloud's own error inside its stream, which stands
    for `status` (the cloud filter's word): kept for that try while the two race, to be
    judged when its answer would go on (`failed_in_stream`); else told the request's context
    when the try is its attempt, as the forwarding app's relay tells it
    (`RequestContext.report_upstream`). A try that lost already is not heard."""
    if hedge is not None and hedge.race is Race.RACING:
        hedge.reported[which] = status
    elif ctx.account is account:
        ctx.report_upstream(status)


def failed_in_stream(hedge: Hedge, machine: AttemptMachine, which: Try) -> bool:
    """Try `which`'s answer would go on with the cloud's error it carried before any content
    (`report`): True when it loses the race with what that error says of its account, the
    other going on as the request's attempt (as the ASGI front's race gives a run that ended
    without content while the other runs: `AttemptMachine.race_failed`), so it is held until
    Envoy resets it; False when no such error was kept for it, or when the race is over and
    the try is the request's attempt: its status goes to the request's context, and the
    machine's own rules apply (the first-token filter's `_failed`)."""
    status = hedge.reported.pop(which, None)
    if status is None:
        return False
    if lost(hedge, machine, which, status):
        return True
    machine.ctx.report_upstream(status)
    return False


def racing(hedge: Hedge | None) -> bool:
    """Whether two tries of the request race (neither is its attempt yet)."""
    return hedge is not None and hedge.race is Race.RACING


def refused(hedge: Hedge, machine: AttemptMachine, which: Try, status: int) -> bool:
    """A try's refusal (`status`) seen by the upstream-level filter: True when it is to be
    held (`HOLD`): the void try's, a racing try's (which then loses), or a try that lost
    already; False: the machine's own rules apply (the try is the request's attempt)."""
    if which is Try.VOID:
        return True
    if hedge.race is Race.OVER and hedge.winner is not None:
        return which is not hedge.winner
    return lost(hedge, machine, which, status)
