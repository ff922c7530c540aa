"""Tenant limits as counters: windows on UTC boundaries, a reservation of the worst case that is
all or nothing across every limit a request touches, and a settle that replaces it by what was
used. Tested on an injected wall clock: nothing sleeps."""

from __future__ import annotations

import calendar
import datetime as dt

import pytest

from switchyard_mw.core.limits import (
    Granted,
    Ledger,
    LimitKey,
    Measure,
    Refused,
    Status,
    estimate_input_tokens,
    window,
)


def at(text: str) -> float:
    """Seconds since the epoch of a UTC time written `2026-12-06 11:59:30`."""
    return calendar.timegm(dt.datetime.fromisoformat(text).timetuple())


class WallClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


TOKENS_MIN = LimitKey(scope="team-a", measure=Measure.TOKENS, per="minute", amount=1000)
TOKENS_DAY = LimitKey(scope="team-a", measure=Measure.TOKENS, per="day", amount=5000)
REQUESTS_MIN = LimitKey(scope="team-a", measure=Measure.REQUESTS, per="minute", amount=2)
OPUS_DEPLOYMENT = LimitKey(
    scope="", measure=Measure.TOKENS, per="minute", amount=1500, model="claude-opus-5"
)


@pytest.mark.parametrize(
    ("per", "now", "start", "end"),
    [
        ("second", "2026-12-06 11:59:30", "2026-12-06 11:59:30", "2026-12-06 11:59:31"),
        ("minute", "2026-12-06 11:59:30", "2026-12-06 11:59:00", "2026-12-06 12:00:00"),
        ("minute", "2026-12-06 12:00:00", "2026-12-06 12:00:00", "2026-12-06 12:01:00"),
        ("hour", "2026-12-06 11:59:30", "2026-12-06 11:00:00", "2026-12-06 12:00:00"),
        ("day", "2026-12-06 23:59:59", "2026-12-06 00:00:00", "2026-12-07 00:00:00"),
        ("month", "2026-12-31 23:59:59", "2026-12-01 00:00:00", "2027-01-01 00:00:00"),
        ("month", "2028-02-29 12:00:00", "2028-02-01 00:00:00", "2028-03-01 00:00:00"),
        ("month", "2027-01-01 00:00:00", "2027-01-01 00:00:00", "2027-02-01 00:00:00"),
    ],
)
def test_windows_start_and_end_on_utc_boundaries(per: str, now: str, start: str, end: str) -> None:
    assert window(per, at(now)) == (at(start), at(end))  # type: ignore[arg-type]


def test_an_unknown_window_is_refused() -> None:
    with pytest.raises(ValueError, match="week"):
        window("week", 0.0)  # type: ignore[arg-type]


def test_a_reservation_takes_the_worst_case_from_every_limit_at_once() -> None:
    clock = WallClock(at("2026-12-06 11:59:00"))
    ledger = Ledger(clock=clock)
    granted = ledger.reserve({TOKENS_MIN: 600, TOKENS_DAY: 600, REQUESTS_MIN: 1})
    assert isinstance(granted, Granted)
    assert ledger.used(TOKENS_MIN) == 600
    assert ledger.used(TOKENS_DAY) == 600
    assert ledger.used(REQUESTS_MIN) == 1
    # the answer's headers come with the grant: each limit after the reservation
    assert granted.statuses[TOKENS_MIN] == Status(limit=1000, remaining=400, reset_secs=60.0)
    assert granted.statuses[REQUESTS_MIN].remaining == 1


def test_all_or_nothing_a_refusal_reserves_nothing_and_names_the_limit() -> None:
    clock = WallClock(at("2026-12-06 11:59:15"))
    ledger = Ledger(clock=clock)
    assert isinstance(ledger.reserve({TOKENS_MIN: 600, TOKENS_DAY: 600}), Granted)
    refused = ledger.reserve({TOKENS_DAY: 500, TOKENS_MIN: 401})
    assert isinstance(refused, Refused)
    assert refused.limit == TOKENS_MIN
    assert refused.retry_after_secs == 45.0  # until the minute's window ends
    assert refused.never is False
    assert refused.status == Status(limit=1000, remaining=400, reset_secs=45.0)
    # nothing of the refused request stays: the day limit is where it was
    assert ledger.used(TOKENS_DAY) == 600
    assert ledger.used(TOKENS_MIN) == 600


def test_the_boundary_exactly_the_limit_is_granted_one_more_is_not() -> None:
    ledger = Ledger(clock=WallClock(at("2026-12-06 11:59:15")))
    assert isinstance(ledger.reserve({TOKENS_MIN: 1000}), Granted)
    assert isinstance(ledger.reserve({TOKENS_MIN: 0.5}), Refused)


def test_a_request_larger_than_the_limit_itself_is_never_admitted() -> None:
    ledger = Ledger(clock=WallClock(at("2026-12-06 11:59:15")))
    refused = ledger.reserve({TOKENS_MIN: 1001})
    assert isinstance(refused, Refused)
    assert refused.never is True


def test_settle_replaces_the_reservation_by_what_was_used() -> None:
    ledger = Ledger(clock=WallClock(at("2026-12-06 11:59:15")))
    granted = ledger.reserve({TOKENS_MIN: 900, REQUESTS_MIN: 1})
    assert isinstance(granted, Granted)
    ledger.settle(granted.reservation, {Measure.TOKENS: 130, Measure.REQUESTS: 1})
    assert ledger.used(TOKENS_MIN) == 130
    assert ledger.used(REQUESTS_MIN) == 1
    # the freed tokens admit the next request at once
    assert isinstance(ledger.reserve({TOKENS_MIN: 870}), Granted)


def test_a_release_gives_everything_back_and_only_once() -> None:
    ledger = Ledger(clock=WallClock(at("2026-12-06 11:59:15")))
    granted = ledger.reserve({TOKENS_MIN: 900, REQUESTS_MIN: 1})
    assert isinstance(granted, Granted)
    ledger.release(granted.reservation)
    ledger.release(granted.reservation)
    ledger.settle(granted.reservation, {Measure.TOKENS: 5})
    assert ledger.used(TOKENS_MIN) == 0
    assert ledger.used(REQUESTS_MIN) == 0


def test_a_new_window_starts_empty_and_a_late_settle_charges_it() -> None:
    clock = WallClock(at("2026-12-06 11:59:50"))
    ledger = Ledger(clock=clock)
    granted = ledger.reserve({TOKENS_MIN: 1000})
    assert isinstance(granted, Granted)
    clock.now = at("2026-12-06 12:00:10")
    assert ledger.used(TOKENS_MIN) == 0
    # the answer ends in the next minute: what it used lands where it became known
    ledger.settle(granted.reservation, {Measure.TOKENS: 300})
    assert ledger.used(TOKENS_MIN) == 300


def test_usd_and_model_limits_only_count_what_is_asked_of_them() -> None:
    usd = LimitKey(scope="team-a", measure=Measure.USD, per="month", amount=50.0)
    ledger = Ledger(clock=WallClock(at("2026-12-06 11:59:15")))
    granted = ledger.reserve({usd: 12.5, OPUS_DEPLOYMENT: 1400})
    assert isinstance(granted, Granted)
    ledger.settle(granted.reservation, {Measure.USD: 0.75, Measure.TOKENS: 200})
    assert ledger.used(usd) == 0.75
    assert ledger.used(OPUS_DEPLOYMENT) == 200


def test_remaining_and_reset_for_the_rate_limit_headers() -> None:
    ledger = Ledger(clock=WallClock(at("2026-12-06 11:59:15")))
    ledger.reserve({TOKENS_MIN: 250, TOKENS_DAY: 250})
    status = ledger.status(TOKENS_MIN)
    assert (status.limit, status.remaining, status.reset_secs) == (1000, 750, 45.0)
    day = ledger.status(TOKENS_DAY)
    assert (day.remaining, day.reset_secs) == (4750, 12 * 3600 + 45)


def test_memory_is_one_counter_per_limit_whatever_the_traffic() -> None:
    clock = WallClock(at("2026-12-06 00:00:00"))
    ledger = Ledger(clock=clock)
    for second in range(5000):
        clock.now = at("2026-12-06 00:00:00") + second
        granted = ledger.reserve({REQUESTS_MIN: 1})
        if isinstance(granted, Granted):
            ledger.release(granted.reservation)
    assert ledger.counters() == 1


@pytest.mark.parametrize(
    ("body_bytes", "expected"),
    [(0, 0), (1, 1), (3, 1), (4, 2), (3000, 1000), (3001, 1001)],
)
def test_the_input_estimate_is_a_third_of_the_body_rounded_up(
    body_bytes: int, expected: int
) -> None:
    assert estimate_input_tokens(body_bytes) == expected
