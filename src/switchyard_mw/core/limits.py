"""Tenant and deployment limits as counters: reserve the worst case, then settle what was used.

A limit counts one measure (tokens, requests or USD) over a fixed window on UTC boundaries
(a second, minute, hour or day from the epoch; a calendar month). Admission reserves a
request's worst case on every limit that applies at once, or on none (`Ledger.reserve`): two
concurrent requests cannot both pass a check that only one of them fits, which is how budgets
that are checked but not reserved get overspent by the number of requests in flight. When the
answer's usage is known, `settle` replaces the reservation by it; a request that never reached
a provider gives it back (`release`).

Fixed windows are what an operator reads on a bill ("50 USD a month", "2M tokens a day") and
what the providers' own rate-limit headers report (a remaining count and a reset time). Their
one error: a window that rolls over frees everything at once, so a burst across the boundary
may spend up to twice a window's amount within one window's length. A settle that arrives
after its window rolled over charges the new window with what was used (where the usage became
known), not the old one.

Memory is one counter per configured limit: a window that has ended is replaced in place by
the current one the next time the limit is touched.

The same counters live in Redis when the state is shared; this module then stands in on each
replica while the store is unreachable.
"""

from __future__ import annotations

import calendar
import datetime as dt
import enum
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

Per = Literal["second", "minute", "hour", "day", "month"]
PERS: tuple[Per, ...] = ("second", "minute", "hour", "day", "month")

_FIXED_SECS: dict[str, int] = {"second": 1, "minute": 60, "hour": 3600, "day": 86400}

BYTES_PER_TOKEN = 3
"""The input estimate's divisor. Tokenizers give English prose about four characters a token,
and a request's JSON adds keys and quotes, so a third of the body's bytes over-counts English
(the reservation is then larger than the use, and the settle gives the difference back). Text
in scripts of three UTF-8 bytes a character (Chinese, Japanese) comes to about a character a
token, so a third is near it; base64 images count far more than they cost until settled."""

WallClock = Callable[[], float]
"""Seconds since the epoch (UTC): windows are calendar windows, so not a monotonic clock."""


class Measure(enum.Enum):
    TOKENS = "tokens"
    REQUESTS = "requests"
    USD = "usd"

    # A member is its only instance: hashed by identity in C, not by Enum's Python-level
    # `__hash__` (a request's reserve and settle look measures up a dozen times).
    __hash__ = object.__hash__


@dataclass(frozen=True, slots=True)
class LimitKey:
    """One configured limit: whose (`scope`: a tenant's name, `""` for the deployment's own
    `[[limits]]`), what it counts, over which window, how much, and for which model (None:
    every model)."""

    scope: str
    measure: Measure
    per: Per
    amount: float
    model: str | None = None
    _hash: int = field(init=False, repr=False, compare=False)
    """Worked out once: a limit is a dict key on every request's reserve and settle (the
    generated hash would hash the five fields, the enum's in Python, each time)."""

    def __post_init__(self) -> None:
        fields = (self.scope, self.measure.value, self.per, self.amount, self.model)
        object.__setattr__(self, "_hash", hash(fields))

    def __hash__(self) -> int:
        return self._hash


@dataclass(frozen=True, slots=True)
class Status:
    """A limit as the providers' rate-limit headers report one."""

    limit: float
    remaining: float
    reset_secs: float


@dataclass(frozen=True, slots=True)
class Reservation:
    """What one request holds: per limit, the window it reserved in and how much."""

    held: tuple[tuple[LimitKey, float, float], ...]
    """(limit, window start, amount reserved) for each limit the request touched."""
    ticket: int
    """Its number in the ledger that granted it: a settle or release undoes it once."""


@dataclass(frozen=True, slots=True)
class Granted:
    reservation: Reservation
    statuses: dict[LimitKey, Status]
    """Each asked limit after the reservation: the answer's rate-limit headers, with no
    second look at the counters (a round trip, where they live in Redis)."""


@dataclass(frozen=True, slots=True)
class Refused:
    limit: LimitKey
    """The first limit (in the order asked) that the request does not fit."""
    retry_after_secs: float
    """Until the limit's window ends: then it is empty."""
    never: bool
    """The request's worst case alone exceeds the limit's amount: no wait admits it."""
    status: Status
    """The refusing limit as it stands (nothing of the request reserved)."""


def window(per: Per, now: float) -> tuple[float, float]:
    """The start and end (epoch seconds, UTC) of the window of kind `per` holding `now`."""
    fixed = _FIXED_SECS.get(per)
    if fixed is not None:
        start = math.floor(now / fixed) * fixed
        return float(start), float(start + fixed)
    if per != "month":
        raise ValueError(f"unknown window {per!r}: one of {', '.join(PERS)}")
    day = dt.datetime.fromtimestamp(now, tz=dt.UTC)
    first = dt.datetime(day.year, day.month, 1, tzinfo=dt.UTC)
    following = dt.datetime(day.year + day.month // 12, day.month % 12 + 1, 1, tzinfo=dt.UTC)
    return float(calendar.timegm(first.timetuple())), float(calendar.timegm(following.timetuple()))


def estimate_input_tokens(body_bytes: int) -> int:
    """A request's input tokens as admission counts them before any tokenizer has seen it."""
    return -(-body_bytes // BYTES_PER_TOKEN)


class Ledger:
    """The counters of every limit in one process."""

    def __init__(self, *, clock: WallClock = time.time) -> None:
        self._clock = clock
        self._windows: dict[LimitKey, tuple[float, float]] = {}
        """Per limit: its current window's start, and what it holds (reserved + used)."""
        self._open: set[int] = set()
        """The tickets of reservations not yet settled or released."""
        self._tickets = 0

    def reserve(self, asks: Mapping[LimitKey, float]) -> Granted | Refused:
        """Reserve `asks` (limit -> amount) on every limit at once, or on none."""
        now = self._clock()
        fits: list[tuple[LimitKey, float, float, float, float]] = []
        for limit, amount in asks.items():
            start, end = window(limit.per, now)
            stored = self._windows.get(limit)
            used = stored[1] if stored is not None and stored[0] == start else 0.0
            if amount > limit.amount or used + amount > limit.amount:
                left = max(0.0, limit.amount - used)
                status = Status(limit.amount, left, end - now)
                return Refused(limit, end - now, never=amount > limit.amount, status=status)
            fits.append((limit, amount, start, end, used))
        held = []
        statuses = {}
        for limit, amount, start, end, used in fits:
            self._windows[limit] = (start, used + amount)
            held.append((limit, start, amount))
            left = max(0.0, limit.amount - used - amount)
            statuses[limit] = Status(limit.amount, left, end - now)
        self._tickets += 1
        reservation = Reservation(tuple(held), self._tickets)
        self._open.add(reservation.ticket)
        return Granted(reservation, statuses)

    def settle(self, reservation: Reservation, used: Mapping[Measure, float]) -> None:
        """Replace the reservation by what the request used (a measure it did not report:
        nothing of it)."""
        self._undo(reservation, lambda limit: used.get(limit.measure, 0.0))

    def release(self, reservation: Reservation) -> None:
        """Give the reservation back whole: the request cost the providers nothing."""
        self._undo(reservation, lambda _limit: 0.0)

    def used(self, limit: LimitKey) -> float:
        """What the limit's current window holds, reserved and used."""
        return self._used_at(limit, self._clock())

    def status(self, limit: LimitKey) -> Status:
        return self._status(limit, self._clock())

    def _status(self, limit: LimitKey, now: float) -> Status:
        remaining = max(0.0, limit.amount - self._used_at(limit, now))
        return Status(limit.amount, remaining, self._left(limit, now))

    def counters(self) -> int:
        """How many counters are kept (one per limit ever touched)."""
        return len(self._windows)

    def _undo(self, reservation: Reservation, charge: Callable[[LimitKey], float]) -> None:
        if reservation.ticket not in self._open:
            return
        self._open.discard(reservation.ticket)
        now = self._clock()
        for limit, start, amount in reservation.held:
            current_start = window(limit.per, now)[0]
            stored = self._windows.get(limit)
            current = stored[1] if stored is not None and stored[0] == current_start else 0.0
            kept = current - amount if current_start == start else current
            self._windows[limit] = (current_start, max(0.0, kept + charge(limit)))

    def _used_at(self, limit: LimitKey, now: float) -> float:
        stored = self._windows.get(limit)
        if stored is None or stored[0] != window(limit.per, now)[0]:
            return 0.0
        return stored[1]

    @staticmethod
    def _left(limit: LimitKey, now: float) -> float:
        return window(limit.per, now)[1] - now
