"""The attempt machine's states and transitions, as data.

`TRANSITIONS` maps each (state, event) the machine takes to the states that event may leave it
in; the event methods of `AttemptMachine` (named as the events are) look their state up here
first and raise `MachineError` for a pair that is not in it, then compute which of those
states follows and what the driver is to do. A pair missing here is an event out of place:
the driver's bug. The table test (tests/engine/test_machine_table.py) reads this table: every
event in every state must be refused where no row allows it, and every transition the machine
makes in the tests must be a row, so a transition added to the code without one fails there.

Queries (`fails_over`, `waits_in_place`, `may_hedge`, `hedge_due`, `first_content_due`,
`ends_in_budget`, `deadline`, `phase`, `sent_at`) and a report for the hedge time's learning
(`content_after`) change nothing and are asked in any state. How far the request may still go
(`Reach`) is the other half of where it stands: it only narrows, and decides which of an
event's states follows.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable


class State(enum.Enum):
    """Where a request's attempts stand."""

    READY = "ready"
    """Built; `begin()` not yet called."""
    CLAIMING = "claiming"
    """A probe lease waits for the shared store's word (`ClaimProbe`)."""
    SENT = "sent"
    """An attempt is in flight (and a hedge may race it); its answer has not started."""
    HOLDING = "holding"
    """The attempt's answer started and is held back: another account may take over."""
    CHECKING = "checking"
    """A 5xx answer held until its attempt ends: the app's framework may have made it of a
    transport error, which is no upstream answer to pass on."""
    READING = "reading"
    """A 400 or 429 answer held until its body is read (`read`): a billing refusal is its
    account's key fault; a context-length refusal moves the request to the next model of its
    chain (`engine.fallbacks`); a 429 is a throttle as ever; any other 400 goes on."""
    FORWARDING = "forwarding"
    """The attempt's answer goes to the client: nothing can follow it."""
    BETWEEN = "between"
    """The attempt failed before reaching the client; `next()` starts another."""
    WAITING = "waiting"
    """No other account can take the request: it waits (`Wait`) to retry in place."""
    DONE = "done"
    """Answered, refused or passed through: no attempt is in flight or will be (but a
    broken stream's continuation, `broke`, or Envoy's own retry, `retried`)."""

    # Members are singletons compared by identity: hash them that way too, in C, rather than
    # by Enum's Python-level hash of the name (the table is looked up on every event).
    __hash__ = object.__hash__


class Reach(enum.Enum):
    """How far the request may still go: it only narrows, OPEN to CLOSED, whatever the state.
    Which of an event's states follows depends on it (in LAST a 5xx is passed on, not held)."""

    OPEN = "open"
    """Another attempt may follow, a retry in place (`Wait`) too."""
    WAITED = "waited"
    """The request's one retry in place is spent: other accounts and models may still follow."""
    LAST = "last"
    """The attempt in flight (or the answer passed on) is the request's last: the front can
    make no other (`retries_over`, Envoy past retrying), the answer is replaced by switchyard's
    own (`replacement`), or it continues a broken stream (`broke`), which nothing fails over."""
    CLOSED = "closed"
    """The request ended (`closed`): nobody waits for anything more."""

    __hash__ = object.__hash__


class KeyRefusal(enum.Enum):
    """Whether the attempt's answer refused its account's key or billing (401, 402, 403, and a
    billing refusal in a 429's or a 400's body): such an answer never reaches the client."""

    NONE = "none"
    READ = "read"
    """The held 400 or 429's body (`read`) is a billing refusal: settled as one at its end."""
    SETTLED = "settled"
    """The last attempt settled was such a refusal: its account is out of the request."""

    __hash__ = object.__hash__


READY, CLAIMING, SENT = State.READY, State.CLAIMING, State.SENT
HOLDING, CHECKING, READING = State.HOLDING, State.CHECKING, State.READING
FORWARDING, BETWEEN, WAITING, DONE = State.FORWARDING, State.BETWEEN, State.WAITING, State.DONE

IN_FLIGHT = frozenset({SENT, HOLDING, CHECKING, READING, FORWARDING})
"""An attempt's lease is out: its end (`ended`) settles it."""
HELD = (HOLDING, CHECKING, READING)
"""An answer started and is held back."""
ONWARD = frozenset({SENT, CLAIMING, WAITING, DONE})
"""Where looking for the next attempt leads: sent, a probe to claim, a wait to retry in place,
or nothing can follow (the held answer or switchyard's own)."""
AFTER_ATTEMPT = frozenset({BETWEEN, DONE})
"""Where an attempt's end leads: another may follow, or the request is answered."""


Rows = dict[tuple[State, str], frozenset[State]]


def _each(states: Iterable[State], event: str, to: frozenset[State]) -> Rows:
    """`event` is taken in each of `states` and leads to `to`."""
    return {(state, event): to for state in states}


def _stays(event: str, states: Iterable[State] = tuple(State)) -> Rows:
    """`event` is taken in `states` and leaves each where it was."""
    return {(state, event): frozenset({state}) for state in states}


TRANSITIONS: Rows = {
    # The first attempt: sent, a probe to claim, or nothing to do (passed through, refused).
    (READY, "begin"): frozenset({SENT, CLAIMING, DONE}),
    # The store's word on a probe: ours (sent; or the request ended meanwhile), else onward.
    (CLAIMING, "probe_claimed"): ONWARD,
    (CLAIMING, "claim_abandoned"): frozenset({DONE}),
    # The answer began: passed on, held to be read, held for failover, or held to check.
    (SENT, "started"): frozenset({FORWARDING, READING, HOLDING, CHECKING}),
    **_each(HELD, "cannot_hold", frozenset({FORWARDING})),
    (READING, "read"): frozenset({READING}),
    (FORWARDING, "first_content"): frozenset({FORWARDING}),
    **_each(IN_FLIGHT, "ended", AFTER_ATTEMPT),
    # A stream's first content came late (ext_proc): another account, else the 504.
    (SENT, "content_late"): AFTER_ATTEMPT,
    (BETWEEN, "next"): ONWARD,
    (WAITING, "waited"): frozenset({SENT, CLAIMING, DONE}),
    # A stream broke after its content started: its continuation, if an account can take it.
    (DONE, "broke"): frozenset({SENT, DONE}),
    # Envoy retried on its own: the attempt in flight ends; a claim under way reports back.
    **_each(IN_FLIGHT, "retried", AFTER_ATTEMPT),
    (CLAIMING, "retried"): frozenset({CLAIMING}),
    (BETWEEN, "retried"): frozenset({BETWEEN}),
    (DONE, "retried"): AFTER_ATTEMPT,
    # A deadline ran out: the 504 is the answer (a claim under way still reports back).
    **_each(set(State) - {CLAIMING}, "expired", frozenset({DONE})),
    (CLAIMING, "expired"): frozenset({CLAIMING}),
    # The front passes the last answer on: switchyard's own instead of a refused key's.
    **_stays("replacement"),
    (BETWEEN, "replacement"): AFTER_ATTEMPT,
    # The front can make no other attempt (`Reach.LAST`): no state changes.
    **_stays("retries_over"),
    # The request ended (`Reach.CLOSED`): a claim under way still reports back.
    **_each(set(State) - {CLAIMING}, "closed", frozenset({DONE})),
    (CLAIMING, "closed"): frozenset({CLAIMING}),
    # A hedge races the attempt in flight (`hedge`) until the race is decided (`hedge_over`).
    (SENT, "hedge"): frozenset({SENT}),
    # The shared hedge budget's word: a hedge if the attempt in flight still has not answered.
    **_stays("hedge_allowed"),
    **_stays("hedge_over", set(State) - {READY, CLAIMING}),
    **_stays("race_failed", set(State) - {READY, CLAIMING}),
}
"""(state, event) -> the states the event may leave the machine in."""

EVENTS = frozenset(event for _, event in TRANSITIONS)
"""The machine's events: the methods whose legality this table says."""


def legal(state: State) -> frozenset[str]:
    """The events `state` takes."""
    return frozenset(event for (at, event) in TRANSITIONS if at is state)
