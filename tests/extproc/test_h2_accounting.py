"""What peers cost the process (`h2_accounting`), alone: bytes held at three levels, each
bound at its exact edge, and the reset budgets of a connection and of the process."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from switchyard_mw.extproc.h2_accounting import (
    Buffers,
    Cut,
    ProcessBytes,
    ProcessResets,
    ResetBudget,
    StreamsCut,
)


@dataclass
class Held:
    held: int = 0


def test_bytes_are_counted_at_every_level_and_given_back() -> None:
    process = ProcessBytes(1000)
    one, two = Buffers(100, 300, process), Buffers(100, 300, process)
    a, b, c = Held(), Held(), Held()
    assert one.add(a, 60) is None
    assert one.add(b, 40) is None
    assert two.add(c, 10) is None
    assert (a.held, b.held, one.held, two.held, process.held) == (60, 40, 100, 10, 110)
    one.release(a, 20)
    assert (a.held, one.held, process.held) == (40, 80, 90)
    one.forget(b)
    assert (b.held, one.held, process.held) == (0, 40, 50)


@pytest.mark.parametrize(
    ("limits", "size", "over"),
    [
        ((100, 1000, 1000), 100, None),
        ((100, 1000, 1000), 101, "stream buffers over 100 bytes"),
        ((1000, 100, 1000), 100, None),
        ((1000, 100, 1000), 101, "connection buffers over 100 bytes"),
        ((1000, 1000, 100), 100, None),
        ((1000, 1000, 100), 101, "process buffers over 100 bytes"),
    ],
)
def test_each_bound_holds_exactly_its_size(
    limits: tuple[int, int, int], size: int, over: str | None
) -> None:
    stream_limit, connection_limit, process_limit = limits
    buffers = Buffers(stream_limit, connection_limit, ProcessBytes(process_limit))
    stream = Held()
    assert buffers.add(stream, size) == over
    assert stream.held == size  # counted either way: the caller fails the stream and forgets it
    buffers.forget(stream)
    assert (stream.held, buffers.held, buffers.process.held) == (0, 0, 0)


@pytest.mark.parametrize(("limits", "room"), [((100, 1000, 1000), 70), ((1000, 50, 1000), 20)])
def test_the_room_a_stream_has_is_what_its_tightest_bound_leaves(
    limits: tuple[int, int, int], room: int
) -> None:
    stream_limit, connection_limit, process_limit = limits
    buffers = Buffers(stream_limit, connection_limit, ProcessBytes(process_limit))
    stream = Held()
    assert buffers.add(stream, 30) is None
    assert buffers.room(stream) == room
    assert buffers.add(stream, room) is None
    assert buffers.add(stream, 1) is not None  # a byte more crosses that bound
    process = ProcessBytes(100)
    Buffers(1000, 1000, process).add(Held(), 90)  # another connection's
    assert Buffers(1000, 1000, process).room(Held()) == 10


def test_the_connection_bound_counts_its_streams_together() -> None:
    buffers = Buffers(100, 150, ProcessBytes(1000))
    assert buffers.add(Held(), 80) is None
    assert buffers.add(Held(), 70) is None
    assert buffers.add(Held(), 1) == "connection buffers over 150 bytes"


def test_the_process_bound_counts_every_connection() -> None:
    process = ProcessBytes(150)
    assert Buffers(100, 100, process).add(Held(), 80) is None
    assert Buffers(100, 100, process).add(Held(), 71) == "process buffers over 150 bytes"


def test_a_reset_budget_allows_its_burst_then_its_rate() -> None:
    budget = ResetBudget(rate=10.0, burst=5, now=0.0)
    assert [budget.spend(0.0) for _ in range(6)] == [True] * 5 + [False]
    assert budget.spend(0.2)  # two earned in 0.2 s: the debt paid, one spent
    assert not budget.spend(0.2)


def test_a_reset_budget_earns_back_no_more_than_its_burst() -> None:
    budget = ResetBudget(rate=10.0, burst=3, now=0.0)
    assert budget.spend(0.0)
    assert [budget.spend(100.0) for _ in range(4)] == [True, True, True, False]


def test_a_spent_budget_stays_one_token_in_debt_at_most() -> None:
    # A peer hammering a spent budget does not push its recovery out for everyone else.
    budget = ResetBudget(rate=10.0, burst=2, now=0.0)
    for _ in range(1000):
        budget.spend(0.0)
    assert budget.tokens == -1.0
    assert budget.spend(0.2)  # two tokens earned back in 0.2 s, whatever came before


def test_the_process_budget_logs_one_line_then_one_per_period() -> None:
    resets = ProcessResets(rate=1.0, burst=1, now=0.0, log_every_secs=60.0)
    assert resets.tripped(1.0) == 1  # the first trip is logged at once
    assert [resets.tripped(t) for t in (2.0, 3.0, 59.0)] == [None, None, None]
    assert resets.tripped(61.0) == 4  # the next line counts every trip since the last
    assert resets.tripped(62.0) is None


def cuts(own_burst: int, process_burst: int) -> StreamsCut:
    return StreamsCut(
        ResetBudget(10.0, own_burst, 0.0),
        ProcessResets(0.5, process_burst, 0.0, log_every_secs=60.0),
    )


def test_past_its_own_budget_a_connection_hangs_up() -> None:
    counter = cuts(own_burst=2, process_burst=100)
    assert counter.count(0.0, asked_to_go=False) == (Cut.WITHIN, None)
    assert counter.count(0.0, asked_to_go=False) == (Cut.WITHIN, None)
    cut, line = counter.count(0.0, asked_to_go=False)
    assert cut is Cut.HANG_UP
    assert line == (
        "ext_proc h2: a client reset or over-opened streams faster than 10/s (burst 2); "
        "closing its connection with ENHANCE_YOUR_CALM"
    )


def test_past_the_process_budget_a_connection_is_asked_to_go_once() -> None:
    counter = cuts(own_burst=100, process_burst=1)
    assert counter.count(0.0, asked_to_go=False) == (Cut.WITHIN, None)
    cut, line = counter.count(0.0, asked_to_go=False)
    assert cut is Cut.CALM_DOWN
    assert line is not None
    assert "faster than 0.5/s (burst 1) across the process; 1 connection(s) asked to go" in line
    # Asked already: counted, nothing more to do (and no line).
    assert counter.count(0.0, asked_to_go=True) == (Cut.WITHIN, None)
    # Another connection within the minute: asked to go, its line folded into the next one.
    assert counter.count(1.0, asked_to_go=False) == (Cut.CALM_DOWN, None)
    cut, line = counter.count(61.0, asked_to_go=False)
    assert cut is Cut.WITHIN  # a minute earned the process's budget back
    assert line is None
