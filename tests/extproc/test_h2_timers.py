"""A connection's timers (`h2_timers`), alone, on a clock the test moves: each limit at its
exact edge, which one wins, and the message timer's choice of late streams."""

from __future__ import annotations

from dataclasses import dataclass

from switchyard_mw.extproc.h2_timers import ConnectionTimers, Expiry


@dataclass(eq=False)
class Arriving:
    partial_at: float


def timers(now: float = 0.0) -> ConnectionTimers[Arriving]:
    return ConnectionTimers(
        now, preface_secs=10.0, idle_secs=300.0, message_secs=30.0, write_stall_secs=20.0
    )


def check(t: ConnectionTimers[Arriving], now: float, **state: bool) -> Expiry:
    return t.expired(
        now,
        streams_open=state.get("streams_open", False),
        waiting_on_peer=state.get("waiting_on_peer", False),
    )


def test_the_preface_must_come_within_its_time() -> None:
    t = timers()
    assert check(t, 10.0) is Expiry.NONE
    assert check(t, 10.01) is Expiry.NO_PREFACE
    greeted = timers()
    greeted.greeted = True
    assert check(greeted, 10.01) is Expiry.NONE


def test_a_connection_without_streams_is_idle_after_its_time() -> None:
    t = timers()
    t.greeted = True
    assert check(t, 300.0) is Expiry.NONE
    assert check(t, 300.01) is Expiry.IDLE
    assert check(t, 1000.0, streams_open=True) is Expiry.NONE  # a stream open: not idle
    t.active_at = 900.0  # a stream ended then
    assert check(t, 1000.0) is Expiry.NONE
    assert check(t, 1200.01) is Expiry.IDLE


def test_answers_waiting_on_the_peer_stall_after_their_time() -> None:
    t = timers()
    t.greeted = True
    assert check(t, 5.0, streams_open=True, waiting_on_peer=True) is Expiry.NONE  # starts
    assert check(t, 25.0, streams_open=True, waiting_on_peer=True) is Expiry.NONE
    assert check(t, 25.01, streams_open=True, waiting_on_peer=True) is Expiry.STALLED


def test_a_write_restarts_the_stall_count() -> None:
    t = timers()
    t.greeted = True
    check(t, 5.0, streams_open=True, waiting_on_peer=True)
    t.sent_at = 20.0  # some answers went out: the peer reads, slowly
    assert check(t, 40.0, streams_open=True, waiting_on_peer=True) is Expiry.NONE
    assert check(t, 40.01, streams_open=True, waiting_on_peer=True) is Expiry.STALLED


def test_a_wait_that_ends_forgets_when_it_began() -> None:
    t = timers()
    t.greeted = True
    check(t, 5.0, streams_open=True, waiting_on_peer=True)
    assert check(t, 6.0, streams_open=True) is Expiry.NONE
    assert t.blocked_at is None
    assert check(t, 30.0, streams_open=True, waiting_on_peer=True) is Expiry.NONE  # anew


def test_the_preface_is_checked_before_the_rest() -> None:
    t = timers()
    t.sent_at = -100.0
    check(t, 0.0, waiting_on_peer=True)
    assert check(t, 400.0, waiting_on_peer=True) is Expiry.NO_PREFACE


def test_a_stall_is_reported_before_idleness() -> None:
    t = timers()
    t.greeted = True
    check(t, 0.0, waiting_on_peer=True)
    assert check(t, 400.0, waiting_on_peer=True) is Expiry.STALLED


def test_late_messages_are_those_arriving_for_over_their_time() -> None:
    t = timers()
    early, edge, late = Arriving(0.0), Arriving(70.0), Arriving(69.99)
    t.partial |= {early, edge, late}
    found = set(t.late(100.0))
    assert found == {early, late}
    for stream in t.late(100.0):  # failing one as it is found changes the set: allowed
        t.partial.discard(stream)
    assert t.partial == {edge}
