"""The hedge budget: at most ``hedge_max_ratio`` of the requests in a sliding window may hedge.

A front notes every request that could hedge (``note_request`` when its first attempt starts)
and asks ``try_hedge`` when that attempt's first-token timer fires; a ``START`` is already
counted, a ``REFUSED`` costs nothing (``switchyard.hedges`` result ``refused``).

Memory is a fixed ring of ``buckets`` counters (requests, hedges), each ``window_secs /
buckets`` wide, never a list of times. The window is the current bucket and the ``buckets - 1``
before it, so an event is counted while it is younger than ``window_secs - width``, never once
it is ``window_secs`` old, and in between depending on where in its bucket it fell: the one
error of the approximation, at most one bucket width.

The ratio is compared in exact fractions of the decimal the operator wrote: 0.29 of 100 requests
is 29 hedges, not the 28.999999999999996 of floats that would refuse the 29th. A window with fewer
requests than one whole hedge (19 at 5 %) allows none: the budget is a cap, never a floor.

Shared across replicas (a state store configured), the same counters live in Redis
(``state/redis_hedge_budget.py``): one hash per model with a field per bucket and counter, changed
by one Lua script on Redis's clock; this module then stands in, locally, while the store is
unreachable.
"""

from __future__ import annotations

import enum
import math
from fractions import Fraction

from .clock import Clock


class HedgeVerdict(enum.Enum):
    START = "start"
    REFUSED = "refused"


class HedgeBudget:
    """Counts requests and hedges over a sliding window and answers whether one more may hedge."""

    def __init__(self, *, max_ratio: float, window_secs: float, buckets: int, clock: Clock) -> None:
        if not 0.0 <= max_ratio <= 1.0:
            raise ValueError(f"max_ratio must be within [0, 1], not {max_ratio}")
        if window_secs <= 0.0 or buckets < 1:
            raise ValueError("window_secs and buckets must be positive")
        self._ratio = Fraction(repr(float(max_ratio)))
        self._width = window_secs / buckets
        self._clock = clock
        # Slot i holds the bucket whose index is _index[i]; a stale index means empty.
        self._index = [-1] * buckets
        self._requests = [0] * buckets
        self._hedges = [0] * buckets

    def note_request(self) -> None:
        slot = self._slot(self._now_index())
        self._requests[slot] += 1

    def try_hedge(self) -> HedgeVerdict:
        now = self._now_index()
        requests, hedges = self._sums(now)
        if (hedges + 1) * self._ratio.denominator > self._ratio.numerator * requests:
            return HedgeVerdict.REFUSED
        self._hedges[self._slot(now)] += 1
        return HedgeVerdict.START

    def counts(self) -> tuple[int, int]:
        """The requests and hedges the window holds now."""
        return self._sums(self._now_index())

    def _now_index(self) -> int:
        return math.floor(self._clock() / self._width)

    def _slot(self, index: int) -> int:
        slot = index % len(self._index)
        if self._index[slot] != index:
            self._index[slot] = index
            self._requests[slot] = 0
            self._hedges[slot] = 0
        return slot

    def _sums(self, now: int) -> tuple[int, int]:
        oldest = now - len(self._index) + 1
        requests = hedges = 0
        for slot, index in enumerate(self._index):
            if oldest <= index <= now:
                requests += self._requests[slot]
                hedges += self._hedges[slot]
        return requests, hedges
