"""``hedge_after_secs = "auto"``: an account's p95 time to first token, clamped."""

from __future__ import annotations

import pytest

from switchyard_mw.core.first_token_tracker import FirstTokenTracker


class FakeClock:
    def __init__(self) -> None:
        self.now = 500.0

    def __call__(self) -> float:
        return self.now


def tracker(clock: FakeClock, *, size: int = 100) -> FirstTokenTracker:
    return FirstTokenTracker(
        window_secs=60.0, size=size, min_samples=20, floor_secs=0.2, ceiling_secs=10.0, clock=clock
    )


@pytest.mark.parametrize(
    ("samples", "expected"),
    [
        ([1.0] * 19, 10.0),  # one short of min_samples: the ceiling
        ([1.0] * 20, 1.0),
        ([float(i) / 10 for i in range(1, 21)], 1.9),  # nearest rank: the 19th of 20
        ([float(i) / 100 for i in range(1, 101)], 0.95),  # the 95th of 100
        ([float(i) / 10 for i in range(1, 61)], 5.7),  # the 57th of 60
        ([0.01] * 50, 0.2),  # the floor
        ([30.0] * 50, 10.0),  # the ceiling
    ],
)
def test_p95_with_floor_and_ceiling(samples: list[float], expected: float) -> None:
    clock = FakeClock()
    t = tracker(clock)
    for s in samples:
        t.record("a", s)
    assert t.hedge_after_secs("a") == pytest.approx(expected)


def test_accounts_are_measured_apart() -> None:
    clock = FakeClock()
    t = tracker(clock)
    for _ in range(20):
        t.record("fast", 0.5)
        t.record("slow", 4.0)
    assert t.hedge_after_secs("fast") == 0.5
    assert t.hedge_after_secs("slow") == 4.0
    assert t.hedge_after_secs("unknown") == 10.0


@pytest.mark.parametrize(("age_secs", "counted"), [(59.999, True), (60.0, False)])
def test_samples_leave_the_window(age_secs: float, counted: bool) -> None:
    clock = FakeClock()
    t = tracker(clock)
    for _ in range(20):
        t.record("a", 3.0)
    clock.now += age_secs
    assert t.hedge_after_secs("a") == (3.0 if counted else 10.0)


def test_the_ring_keeps_the_latest_samples() -> None:
    clock = FakeClock()
    t = tracker(clock, size=20)
    for _ in range(20):
        t.record("a", 8.0)
    for _ in range(20):
        clock.now += 0.1
        t.record("a", 1.0)
    assert t.hedge_after_secs("a") == 1.0
    assert t.samples("a") == 20


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="floor"):
        FirstTokenTracker(
            window_secs=60.0,
            size=10,
            min_samples=5,
            floor_secs=3.0,
            ceiling_secs=2.0,
            clock=FakeClock(),
        )
    with pytest.raises(ValueError, match="min_samples"):
        FirstTokenTracker(
            window_secs=60.0,
            size=10,
            min_samples=11,
            floor_secs=0.1,
            ceiling_secs=2.0,
            clock=FakeClock(),
        )
