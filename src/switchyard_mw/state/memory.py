"""The embedded store: state stays in the process, as the pool holds it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.pool import AccountPool
from ..core.shared import Change, Shared

if TYPE_CHECKING:
    from ..core.shared import TripBoard


class MemoryStore:
    """Shares nothing. Binding it attaches nothing to the pool, so the pool never calls it."""

    name = "memory"

    def bind(self, pool: AccountPool) -> None:
        pass

    def changed(
        self, account: str, change: Change, local: Shared, *, model: str | None = None
    ) -> None:
        pass

    def held(self, account: str, model: str, until_unix: float) -> None:
        pass

    def share_trips(self, canaries: TripBoard) -> None:
        pass  # one process: its canary guard decides alone

    async def claim_probe(self, account: str, model: str | None = None) -> Shared | None:
        return None  # one process: the pool's own probe slot is the only one

    async def start(self) -> None:
        pass

    async def aclose(self) -> None:
        pass
