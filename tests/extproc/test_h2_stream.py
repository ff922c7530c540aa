"""A stream's states (`h2_stream`) as a table, in the manner of h11's `test_state.py`: every
transition, every input a state refuses, and the sets the transport asks about."""

from __future__ import annotations

import itertools

import pytest

from switchyard_mw.extproc.h2_framing import frame
from switchyard_mw.extproc.h2_stream import (
    FINISHING,
    REQUEST_DONE,
    TAKING,
    TRANSITIONS,
    UNANSWERED,
    Stream,
    StreamInput,
    StreamState,
    advance,
)

S = StreamState
I = StreamInput  # noqa: E741

EXPECTED = [
    # the request arriving, nothing answered
    (S.OPEN, I.ANSWER, S.ANSWERING),
    (S.OPEN, I.REQUEST_END, S.REQUEST_DONE),
    (S.OPEN, I.CLOSE, S.CLOSED),
    (S.REQUEST_DONE, I.ANSWER, S.ANSWERING_REQUEST_DONE),
    (S.REQUEST_DONE, I.REQUEST_END, S.REQUEST_DONE),
    (S.REQUEST_DONE, I.CLOSE, S.CLOSED),
    # answering
    (S.ANSWERING, I.REQUEST_END, S.ANSWERING_REQUEST_DONE),
    (S.ANSWERING, I.FINISH, S.FINISHING),
    (S.ANSWERING, I.CLOSE, S.CLOSED),
    (S.ANSWERING_REQUEST_DONE, I.REQUEST_END, S.ANSWERING_REQUEST_DONE),
    (S.ANSWERING_REQUEST_DONE, I.FINISH, S.FINISHING_REQUEST_DONE),
    (S.ANSWERING_REQUEST_DONE, I.CLOSE, S.CLOSED),
    # the trailers waiting on queued answers
    (S.FINISHING, I.REQUEST_END, S.FINISHING_REQUEST_DONE),
    (S.FINISHING, I.FINISH, S.FINISHING),
    (S.FINISHING, I.CLOSE, S.CLOSED),
    (S.FINISHING_REQUEST_DONE, I.REQUEST_END, S.FINISHING_REQUEST_DONE),
    (S.FINISHING_REQUEST_DONE, I.FINISH, S.FINISHING_REQUEST_DONE),
    (S.FINISHING_REQUEST_DONE, I.CLOSE, S.CLOSED),
    # a closed stream's task unwinding
    (S.CLOSED, I.REQUEST_END, S.CLOSED),
    (S.CLOSED, I.FINISH, S.CLOSED),
    (S.CLOSED, I.CLOSE, S.CLOSED),
]
REFUSED = [
    (S.OPEN, I.FINISH),  # nothing answered: trailers only, straight to CLOSED
    (S.REQUEST_DONE, I.FINISH),
    (S.ANSWERING, I.ANSWER),  # the response headers go once
    (S.ANSWERING_REQUEST_DONE, I.ANSWER),
    (S.FINISHING, I.ANSWER),
    (S.FINISHING_REQUEST_DONE, I.ANSWER),
    (S.CLOSED, I.ANSWER),
]


@pytest.mark.parametrize(("state", "event", "after"), EXPECTED)
def test_transition(state: StreamState, event: StreamInput, after: StreamState) -> None:
    assert advance(state, event) is after
    stream = Stream(1, b"/x")
    stream.state = state
    assert stream.step(event) is state
    assert stream.state is after


@pytest.mark.parametrize(("state", "event"), REFUSED)
def test_refused(state: StreamState, event: StreamInput) -> None:
    with pytest.raises(RuntimeError, match=f"stream state: {event.name} in {state.name}"):
        advance(state, event)
    stream = Stream(1, b"/x")
    stream.state = state
    with pytest.raises(RuntimeError):
        stream.step(event)
    assert stream.state is state


def test_the_table_is_exactly_the_expected_and_refused_pairs() -> None:
    every = set(itertools.product(StreamState, StreamInput))
    expected = {(state, event) for state, event, _ in EXPECTED}
    assert set(TRANSITIONS) == expected
    assert expected | set(REFUSED) == every
    assert not expected & set(REFUSED)


def test_every_state_is_reached_from_open() -> None:
    reached, frontier = {S.OPEN}, [S.OPEN]
    while frontier:
        state = frontier.pop()
        for (before, _), after in TRANSITIONS.items():
            if before is state and after not in reached:
                reached.add(after)
                frontier.append(after)
    assert reached == set(StreamState)


def test_closed_is_the_end_of_every_state() -> None:
    for state in StreamState:
        assert advance(state, I.CLOSE) is S.CLOSED


def test_the_sets_the_transport_asks_about() -> None:
    assert {S.OPEN, S.REQUEST_DONE} == UNANSWERED
    assert {S.OPEN, S.REQUEST_DONE, S.ANSWERING, S.ANSWERING_REQUEST_DONE} == TAKING
    assert {S.FINISHING, S.FINISHING_REQUEST_DONE} == FINISHING
    assert {s for s in StreamState if advance_or_none(s, I.REQUEST_END) is s} - {
        S.CLOSED
    } == REQUEST_DONE


def advance_or_none(state: StreamState, event: StreamInput) -> StreamState | None:
    try:
        return advance(state, event)
    except RuntimeError:
        return None


@pytest.mark.parametrize(
    ("state", "work", "cut_short"),
    [
        (S.OPEN, None, True),  # nothing answered yet
        (S.REQUEST_DONE, None, True),
        (S.ANSWERING, None, False),  # answered, nothing under way: how Envoy ends a stream
        (S.ANSWERING, "working", True),  # a handler answering a message
        (S.ANSWERING, "pending", True),
        (S.ANSWERING, "partial", True),
        (S.ANSWERING_REQUEST_DONE, None, False),
        (S.FINISHING, None, False),
    ],
)
def test_a_reset_cuts_work_short_while_something_is_unanswered(
    state: StreamState, work: str | None, cut_short: bool
) -> None:
    stream = Stream(1, b"/x")
    stream.state = state
    if work == "working":
        stream.working = True
    elif work == "pending":
        stream.pending.append(memoryview(b"m"))
    elif work == "partial":
        stream.add(frame(b"abc")[:4])
    assert stream.unanswered_work() is cut_short
