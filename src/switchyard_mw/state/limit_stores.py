"""Where the tenants' limits are counted: in each process, or shared through Redis.

`LimitStore` is what a front awaits at a request's admission (`reserve`) and end (`settle` or
`release`); `LocalLimits` is the in-process one, `core.limits.Ledger` behind it. A shared store
(Redis) runs each step as one atomic script over every key the request touches and, while
Redis cannot be reached, a `LocalLimits` stands in, one whose amounts are each limit's share
(`[state] replicas_hint`): no request waits on a dead store.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from ..core.limits import Granted, Ledger, LimitKey, Measure, Refused, Reservation, WallClock


class LimitStore(Protocol):
    name: str
    """`memory` or `redis`, as `[state] backend` names it."""

    async def reserve(self, asks: Mapping[LimitKey, float]) -> Granted | Refused:
        """Reserve `asks` (limit -> amount) on every limit at once, or on none."""

    async def settle(self, reservation: Reservation, used: Mapping[Measure, float]) -> None:
        """Replace the reservation by what the request used."""

    async def release(self, reservation: Reservation) -> None:
        """Give the reservation back whole."""

    def used(self, limit: LimitKey) -> float:
        """What the limit's current window holds, as this process last knew it (for
        `GET /switchyard/tenants`)."""


class LocalLimits:
    """The limits of this process alone."""

    name = "memory"

    def __init__(self, *, ledger: Ledger | None = None, clock: WallClock | None = None) -> None:
        if ledger is None:
            ledger = Ledger() if clock is None else Ledger(clock=clock)
        self.ledger = ledger

    async def reserve(self, asks: Mapping[LimitKey, float]) -> Granted | Refused:
        return self.ledger.reserve(asks)

    async def settle(self, reservation: Reservation, used: Mapping[Measure, float]) -> None:
        self.ledger.settle(reservation, used)

    async def release(self, reservation: Reservation) -> None:
        self.ledger.release(reservation)

    def used(self, limit: LimitKey) -> float:
        return self.ledger.used(limit)
