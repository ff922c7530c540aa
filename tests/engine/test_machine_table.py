"""The attempt machine against its table (`engine/transitions.py`), read as data.

Every event is tried in every state: where the table has no row the machine refuses it
(`MachineError`, state unchanged); where it has one, the state it lands in is one the row
names. The scenario rows of test_machine.py and this drive together reach every row, so a
row the machine can no longer take fails here too. (tests/engine/conftest.py checks every
transition any engine test makes against the same table.)
"""

from __future__ import annotations

import pytest
from machine_moves import Move, machine_moves  # noqa: F401 (autouse: each move is a row)
from test_machine import (
    TABLE,
    WAIT_CONFIG,
    Env,
    Setup,
    begun,
    between,
    checking,
    claiming,
    done,
    forwarding,
    holding,
    nothing,
    reading,
    waiting,
)

from switchyard_mw.engine.machine import AttemptMachine, How, MachineError
from switchyard_mw.engine.transitions import EVENTS, TRANSITIONS, State, legal

REACHING: dict[State, Setup] = {
    State.READY: nothing,
    State.CLAIMING: claiming,
    State.SENT: begun,
    State.HOLDING: holding,
    State.CHECKING: checking,
    State.READING: reading,
    State.FORWARDING: forwarding,
    State.BETWEEN: between,
    State.WAITING: waiting,
    State.DONE: done,
}
"""A way to each state, through plain events."""

ARGS: dict[str, tuple[object, ...]] = {
    "probe_claimed": (None,),
    "started": (200,),
    "read": (b"{}",),
    "ended": (How.FINISHED,),
    "broke": ("cut", 10, frozenset({"a", "b"})),
}
KW: dict[str, dict[str, object]] = {
    "hedge_over": {"won": False},
    "race_failed": {"hedge": True, "status": 500, "error": None},  # `report`: in `fire`
    "hedge_allowed": {"allowed": False},
}


def in_state(state: State) -> tuple[Env, AttemptMachine]:
    env = Env(WAIT_CONFIG if state is State.WAITING else Env.config)
    machine = env.machine()
    REACHING[state](env, machine)
    assert machine.state is state
    return env, machine


def fire(machine: AttemptMachine, event: str) -> object:
    method = getattr(machine, event)
    kw = KW.get(event, {})
    if event == "race_failed":  # the context the race's app reported into, as the driver's
        kw = {**kw, "report": machine.ctx}
    return method(*ARGS.get(event, ()), **kw)


def test_every_state_has_a_way_in_and_every_event_a_row() -> None:
    assert set(REACHING) == set(State)
    assert {state for state, _ in TRANSITIONS} == set(State)
    assert all(callable(getattr(AttemptMachine, event, None)) for event in EVENTS)
    assert len(TRANSITIONS) >= 70  # the table was read


@pytest.mark.parametrize("state", list(State), ids=lambda s: s.name)
def test_an_event_with_no_row_is_refused(state: State) -> None:
    refused = sorted(EVENTS - legal(state))
    assert refused or state is State.DONE or state is State.SENT  # most states refuse some
    for event in refused:
        _, machine = in_state(state)
        with pytest.raises(MachineError, match=event):
            fire(machine, event)
        assert machine.state is state, event


RACING = frozenset({"hedge_over", "race_failed"})
ORDER = {state: index for index, state in enumerate(State)}
TAKEN = sorted(
    (
        (state, event)
        for (state, event) in TRANSITIONS
        if event not in RACING  # need a hedge in flight: test_machine_hedge.py drives them
    ),
    # In one order in every process: pytest-xdist's workers must collect the same tests, and
    # rows built from a set of states come in an order that varies with the process.
    key=lambda row: (ORDER[row[0]], row[1]),
)


@pytest.mark.parametrize(("state", "event"), TAKEN, ids=[f"{s.name}-{e}" for s, e in TAKEN])
def test_an_event_with_a_row_lands_where_the_row_says(state: State, event: str) -> None:
    _, machine = in_state(state)
    fire(machine, event)
    assert machine.state in TRANSITIONS[state, event]


def test_every_row_is_reached(request: pytest.FixtureRequest) -> None:
    """By the scenario rows and a plain drive of each row: a row no path reaches is dead."""
    moves: list[Move] = request.getfixturevalue("machine_moves")
    for row in TABLE.values():
        env = Env(row.config)
        machine = env.machine()
        row.setup(env, machine)
        row.event(env, machine)
    for state, event in TAKEN:
        _, machine = in_state(state)
        fire(machine, event)
    reached = {(before, event) for before, event, _ in moves}
    unreached = {(s, e) for s, e in set(TRANSITIONS) - reached if e not in RACING}
    assert not unreached
