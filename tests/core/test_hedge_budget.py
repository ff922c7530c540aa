"""The hedge budget: at most ``max_ratio`` of the requests in a sliding window start a hedge."""

from __future__ import annotations

import pytest

from switchyard_mw.core.hedge_budget import HedgeBudget, HedgeVerdict


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def budget(clock: FakeClock, *, ratio: float = 0.05) -> HedgeBudget:
    return HedgeBudget(max_ratio=ratio, window_secs=10.0, buckets=10, clock=clock)


@pytest.mark.parametrize(
    ("requests", "ratio", "hedges_allowed"),
    [
        (19, 0.05, 0),  # 19 x 0.05 = 0.95: not one whole hedge yet
        (20, 0.05, 1),  # exactly 1
        (39, 0.05, 1),
        (40, 0.05, 2),
        (60, 0.05, 3),
        (100, 0.29, 29),  # 0.29 x 100 is 28.999999999999996 in floats: counted exactly
        (100, 0.1, 10),
        (3, 1.0, 3),
        (7, 0.0, 0),
    ],
)
def test_hedges_allowed_in_one_window(requests: int, ratio: float, hedges_allowed: int) -> None:
    clock = FakeClock()
    b = budget(clock, ratio=ratio)
    for _ in range(requests):
        b.note_request()
    verdicts = [b.try_hedge() for _ in range(hedges_allowed + 2)]
    assert verdicts.count(HedgeVerdict.START) == hedges_allowed
    assert verdicts[hedges_allowed:] == [HedgeVerdict.REFUSED] * 2
    assert b.counts() == (requests, hedges_allowed)


def test_a_refusal_leaves_room_for_later_requests() -> None:
    clock = FakeClock()
    b = budget(clock)
    for _ in range(19):
        b.note_request()
    assert b.try_hedge() is HedgeVerdict.REFUSED
    b.note_request()
    assert b.try_hedge() is HedgeVerdict.START


@pytest.mark.parametrize(
    ("age_secs", "counted"),
    [
        (0.0, True),
        (8.999, True),  # younger than window - bucket width: always counted
        (9.0, True),  # in the oldest bucket still held (the clock sits at a bucket start)
        (9.999, True),
        (10.0, False),  # a whole window old: never counted
        (25.0, False),
    ],
)
def test_window_boundary(age_secs: float, counted: bool) -> None:
    clock = FakeClock()  # 1000.0 is a bucket start (width 1 s)
    b = budget(clock, ratio=1.0)
    b.note_request()
    assert b.try_hedge() is HedgeVerdict.START
    clock.now += age_secs
    assert b.counts() == ((1, 1) if counted else (0, 0))


def test_events_dropped_within_one_bucket_of_the_window() -> None:
    # The approximation's one error: an event late in its bucket leaves the window when its
    # bucket does, up to one bucket width (window / buckets) early.
    clock = FakeClock()
    b = budget(clock, ratio=1.0)
    clock.now = 1000.9
    b.note_request()
    clock.now = 1010.0  # the event is 9.1 s old: its bucket (1000) has left
    assert b.counts() == (0, 0)
    clock.now = 1009.99  # 9.09 s old: still held
    assert b.counts() == (1, 0)


def test_old_hedges_stop_counting_against_the_budget() -> None:
    clock = FakeClock()
    b = budget(clock)
    for _ in range(20):
        b.note_request()
    assert b.try_hedge() is HedgeVerdict.START
    clock.now += 10.0
    for _ in range(20):
        b.note_request()
    assert b.try_hedge() is HedgeVerdict.START
    assert b.try_hedge() is HedgeVerdict.REFUSED


def test_a_long_run_counts_what_the_window_holds() -> None:
    # 10,000 requests, one every 0.37 s, in a ring of 10 counters: the counts stay those of
    # the events younger than the window, within one bucket width.
    clock = FakeClock()
    b = budget(clock, ratio=0.5)
    times = []
    for _ in range(10_000):
        clock.now += 0.37
        times.append(clock.now)
        b.note_request()
    requests, _ = b.counts()
    assert sum(1 for t in times if clock.now - t < 9.0) <= requests
    assert requests <= sum(1 for t in times if clock.now - t < 10.0)


def test_a_clock_gap_longer_than_the_window_forgets_everything() -> None:
    clock = FakeClock()
    b = budget(clock, ratio=1.0)
    for _ in range(5):
        b.note_request()
    clock.now += 3600.0
    assert b.counts() == (0, 0)
    assert b.try_hedge() is HedgeVerdict.REFUSED


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_ratio": -0.1},
        {"max_ratio": 1.5},
        {"window_secs": 0.0},
        {"buckets": 0},
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, float]) -> None:
    args: dict[str, float] = {"max_ratio": 0.05, "window_secs": 10.0, "buckets": 10}
    args.update(kwargs)
    with pytest.raises(ValueError, match="must be"):
        HedgeBudget(
            max_ratio=args["max_ratio"],
            window_secs=args["window_secs"],
            buckets=int(args["buckets"]),
            clock=FakeClock(),
        )
