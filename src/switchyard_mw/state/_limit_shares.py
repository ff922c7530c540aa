"""One replica's share of every limit, enforced in process while the shared store is down.

A limit's share is ``amount / replicas_hint``. The first time a share is used in an outage it
is raised to this replica's share of what the store last said the window held (the seed): the
replicas together then spend what was left of the limit, not a whole limit on top of it. What
the share reserved beyond its seeds is what the store has not counted; after the outage it
goes up (`unshared`, then `pushed`), once.

Local windows are on this host's clock; the store's on Redis's. Near a window's boundary the
two may name different windows when the clocks disagree: a seed or a push for a window that
is over is then dropped (the erring one is at most one window's share).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ..core.limits import Granted, LimitKey, Measure, Refused, Reservation, WallClock, window
from .limit_stores import LocalLimits


class Shares:
    def __init__(self, *, replicas_hint: int, clock: WallClock) -> None:
        self._hint = replicas_hint
        self._clock = clock
        self._local = LocalLimits(clock=clock)
        self._seeds: dict[LimitKey, tuple[float, float, int]] = {}
        """Per limit: the local window it was seeded in, with how much, and in which outage."""
        self._pushed: dict[LimitKey, tuple[float, float]] = {}
        """Per limit: the local window, and how much of its use went up to the store."""

    @property
    def hint(self) -> int:
        return self._hint

    def share(self, limit: LimitKey) -> LimitKey:
        return dataclasses.replace(limit, amount=limit.amount / self._hint)

    async def reserve(
        self, asks: Mapping[LimitKey, float], last_read: Mapping[LimitKey, float], outage: int
    ) -> tuple[Granted | Refused, Reservation | None]:
        """Reserve on the shares; `last_read`: what the store last said each window holds (a
        limit absent: nothing known); `outage`: which outage this is (a new one seeds anew).
        The outward answer (in the configured limits), and the local reservation behind a
        grant."""
        shares = {self.share(limit): limit for limit in asks}
        for share, limit in shares.items():
            self._seed(limit, share, last_read.get(limit, 0.0), outage)
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
        seeded = self._seeds.get(limit)
        seed = seeded[1] if seeded is not None and seeded[0] == start else 0.0
        pushed = _in(self._pushed.get(limit), start)
        return start, max(0.0, counted - seed - pushed)

    def pushed(self, limit: LimitKey, start: float, amount: float) -> None:
        self._pushed[limit] = (start, _in(self._pushed.get(limit), start) + amount)

    def _seed(self, limit: LimitKey, share: LimitKey, read: float, outage: int) -> None:
        start = window(limit.per, self._clock())[0]
        seeded = self._seeds.get(limit)
        if seeded is not None and seeded[0] == start and seeded[2] == outage:
            return
        before = seeded[1] if seeded is not None and seeded[0] == start else 0.0
        # Up to this replica's share of what it read last: in an earlier outage of this
        # window the share counted what it read then, and its own use since went up.
        top = min(share.amount, read / self._hint) - self._local.used(share)
        if top > 0:
            # Held until the window ends, never settled: the others' use, not ours.
            self._local.ledger.reserve({share: top})
        self._seeds[limit] = (start, before + max(0.0, top), outage)


def _in(entry: tuple[float, float] | None, start: float) -> float:
    return entry[1] if entry is not None and entry[0] == start else 0.0
