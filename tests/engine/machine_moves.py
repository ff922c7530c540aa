"""Every transition an attempt machine makes in a test is a row of its table.

Imported by the machine's test modules (`from machine_moves import machine_moves`), its
autouse fixture wraps the machine's event methods (`transitions.EVENTS`) for the test: each
event a driver (or a test) calls is recorded as (state before, event, state after), and the
test fails at its end when one is not in `transitions.TRANSITIONS`. So a transition added to
the code without a row fails the tests that reach it, whichever drives the machine (a table
row, a whole request, the two fronts).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from switchyard_mw.engine.machine import AttemptMachine
from switchyard_mw.engine.transitions import EVENTS, TRANSITIONS, State

Move = tuple[State, str, State]


def unlisted(moves: list[Move]) -> list[Move]:
    """The moves no row of the table allows."""
    return [m for m in moves if m[2] not in TRANSITIONS.get((m[0], m[1]), frozenset())]


def _recording(name: str, moves: list[Move], inside: set[int]) -> Callable[..., object]:
    method = getattr(AttemptMachine, name)

    def event(self: AttemptMachine, *args: object, **kw: object) -> object:
        if id(self) in inside:  # an event the machine calls itself (`retried` -> `ended`)
            return method(self, *args, **kw)
        before = self.state
        inside.add(id(self))
        try:
            action = method(self, *args, **kw)
        finally:
            inside.discard(id(self))
        moves.append((before, name, self.state))
        return action

    return event


@pytest.fixture(autouse=True)
def machine_moves(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Move]]:
    """The (state, event, state) moves of every machine in the test, checked at its end."""
    moves: list[Move] = []
    inside: set[int] = set()
    for name in EVENTS:
        monkeypatch.setattr(AttemptMachine, name, _recording(name, moves, inside))
    yield moves
    missing = unlisted(moves)
    assert not missing, f"transitions with no row in engine/transitions.py: {missing}"
