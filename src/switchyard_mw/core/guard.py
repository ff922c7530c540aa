"""The canary guard's arithmetic (sans-IO): attempts and faults over a sliding window.

A window of `window_secs` is kept as ten slots of a tenth each: counting is an addition to the
current slot, reading sums ten numbers, and what is older than the window falls out a tenth at
a time (so a count may include up to a tenth of a window more than `window_secs`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .clock import Clock

SLOTS = 10


@dataclass(frozen=True, slots=True)
class GuardRule:
    """When a variant is rolled back: over the last `window_secs`, at least `min_requests`
    attempts and a fault rate above both `max_fault_rate` and the base model's."""

    max_fault_rate: float
    min_requests: int
    window_secs: float

    def __post_init__(self) -> None:
        if not 0 <= self.max_fault_rate <= 1:
            raise ValueError("max_fault_rate must be between 0 and 1")
        if self.min_requests < 1:
            raise ValueError("min_requests must be >= 1")
        if not self.window_secs > 0:
            raise ValueError("window_secs must be > 0")

    def trips(self, variant: tuple[int, int], base: tuple[int, int]) -> bool:
        """Whether a variant's (attempts, faults) against its base's break the rule."""
        attempts, faults = variant
        if attempts < self.min_requests:
            return False
        rate = faults / attempts
        base_rate = base[1] / base[0] if base[0] else 0.0
        return rate > self.max_fault_rate and rate > base_rate


class Window:
    """Attempts and faults of one model over the last `window_secs` (injected clock)."""

    __slots__ = ("_attempts", "_clock", "_faults", "_slot", "_width")

    def __init__(self, *, window_secs: float, clock: Clock) -> None:
        self._clock = clock
        self._width = window_secs / SLOTS
        self._attempts = [0] * SLOTS
        self._faults = [0] * SLOTS
        self._slot = -math.inf  # the slot number (time / width) last written

    def _advance(self) -> int:
        """Clear the slots the clock has moved past; the index of the current one."""
        now = math.floor(self._clock() / self._width)
        passed = now - self._slot
        if passed >= SLOTS:  # the whole window went by (or nothing was ever counted)
            self._attempts = [0] * SLOTS
            self._faults = [0] * SLOTS
        elif passed > 0:
            for slot in range(int(self._slot) + 1, now + 1):
                self._attempts[slot % SLOTS] = self._faults[slot % SLOTS] = 0
        if passed > 0:
            self._slot = float(now)  # one type for the slot: -inf before the first write
        return now % SLOTS

    def add(self, *, fault: bool) -> None:
        index = self._advance()
        self._attempts[index] += 1
        if fault:
            self._faults[index] += 1

    def counts(self) -> tuple[int, int]:
        """(attempts, faults) in the window now."""
        self._advance()
        return sum(self._attempts), sum(self._faults)
