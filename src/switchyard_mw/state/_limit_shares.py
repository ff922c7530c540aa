"""One replica's share of every limit, enforced in process while the shared store is down.

A limit's share is ``amount / replicas_hint``. The first time a share is used in a window it
starts from this replica's share of what the store last said the window held (the seed): the
replicas together then spend what was left of the limit, not a whole limit on top of it. What
the share reserved beyond its seed is what the store has not counted; after the outage it goes
up (`unshared`, then `pushed`), once.

Local windows are on this host's clock; the store's on Redis's. Near a window's boundary the
two may name different windows when the clocks disagree: a seed or a push for a window that
is over is then dropped (the erring one is at most one window's share).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ..core.limits import Granted, LimitKey, Measure, Refused, Reservation, WallClock, window
from .limits import LocalLimits


class Shares:
    def __init__(self, *, replicas_hint: int, clock: WallClock) -> None:
        self._hint = replicas_hint
        self._clock = clock
        self._local = LocalLimits(clock=clock)
        self._seeds: dict[LimitKey, tuple[float, float]] = {}
        """Per limit: the local window it was seeded in, and with how much."""
        self._pushed: dict[LimitKey, tuple[float, float]] = {}
        """Per limit: the local window, and how much of its use went up to the store."""

    @property
    def hint(self) -> int:
        return self._hint

    def share(self, limit: LimitKey) -> LimitKey:
        return dataclasses.replace(limit, amount=limit.amount / self._hint)

    async def reserve(
        self, asks: Mapping[LimitKey, float], last_read: Mapping[LimitKey, float]
    ) -> tuple[Granted | Refused, Reservation | None]:
        """Reserve on the shares; `last_read`: what the store last said each window holds (a
        limit absent: nothing known). The outward answer (in the configured limits), and the
        local reservation behind a grant."""
        shares = {self.share(limit): limit for limit in asks}
        for share, limit in shares.items():
            self._seed(limit, share, last_read.get(limit, 0.0))
        outcome = await self._local.reserve({share: asks[limit] for share, limit in shares.items()})
        if isinstance(outcome, Refused):
            return dataclasses.replace(outcome, limit=shares[outcome.limit]), None
        local = outcome.reservation
        held = tuple((shares[share], start, amount) for share, start, amount in local.held)
        statuses = {shares[share]: status for share, status in outcome.statuses.items()}
        return Granted(Reservation(held, 0), statuses), local

    async def settle(self, reservation: Reservation, used: Mapping[Measure, float] | None) -> None:
        if used is None:
            await self._local.release(reservation)
        else:
            await self._local.settle(reservation, used)

    def used(self, limit: LimitKey) -> float:
        return self._local.used(self.share(limit))

    def known(self) -> list[LimitKey]:
        """The limits the shares have counted (seeded or reserved on)."""
        return list(self._seeds)

    def unshared(self, limit: LimitKey) -> tuple[float, float]:
        """(this window's start, what the share holds beyond its seed and what went up)."""
        start = window(limit.per, self._clock())[0]
        counted = self._local.used(self.share(limit))
        seed = _in(self._seeds.get(limit), start)
        pushed = _in(self._pushed.get(limit), start)
        return start, max(0.0, counted - seed - pushed)

    def pushed(self, limit: LimitKey, start: float, amount: float) -> None:
        self._pushed[limit] = (start, _in(self._pushed.get(limit), start) + amount)

    def _seed(self, limit: LimitKey, share: LimitKey, read: float) -> None:
        start = window(limit.per, self._clock())[0]
        if (seeded := self._seeds.get(limit)) is not None and seeded[0] == start:
            return
        amount = min(share.amount, read / self._hint)
        self._seeds[limit] = (start, amount)
        if amount > 0:
            # Held until the window ends, never settled: the others' use, not ours.
            self._local.ledger.reserve({share: amount})


def _in(entry: tuple[float, float] | None, start: float) -> float:
    return entry[1] if entry is not None and entry[0] == start else 0.0
