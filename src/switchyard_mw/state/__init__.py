"""Where account health lives: in each process (``memory``) or shared through Redis (``redis``).

:func:`build_store` turns the config's ``[state]`` table into a :class:`Store`; the pool it is
bound to keeps making every decision from its local view, and the store keeps that view in step
with the other replicas (see :mod:`switchyard_mw.core.shared`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, TypedDict

from ..config import State, sentinel_address
from ..core.pool import AccountPool
from ..core.shared import StateStore
from ..errors import StartupError, install_hint
from .limit_stores import LimitStore, LocalLimits
from .memory import MemoryStore

if TYPE_CHECKING:
    from ..core.shared import TripBoard
    from ._redis_io import Mode

__all__ = ["LimitStore", "MemoryStore", "Store", "build_limits", "build_store"]


class Store(StateStore, Protocol):
    """A :class:`~switchyard_mw.core.shared.StateStore` with a lifecycle."""

    name: str
    """The backend, as `[state] backend` names it."""

    def bind(self, pool: AccountPool) -> None:
        """Share ``pool``'s state (one pool per store)."""

    def share_trips(self, canaries: TripBoard) -> None:
        """Share ``canaries``' guard trips: each one this process makes goes to the others,
        and theirs are applied here (those in force before it started too). A second call is a
        reload: its guards start afresh, and the trips shared so far end."""

    async def start(self) -> None:
        """Connect and catch up; returns within a small bound even if the backend is down."""

    async def aclose(self) -> None:
        """Stop background work and close connections."""


def build_store(state: State) -> Store:
    """The store `[state]` asks for; `StartupError` if its client library is missing."""
    if state.backend == "memory":
        return MemoryStore()
    try:
        from .redis_store import RedisStore
    except ImportError as exc:
        raise _no_redis(exc) from None
    if state.mode == "cluster":
        _require_cluster_pubsub()
    return RedisStore(state.url, **_redis_target(state), probe_lease_secs=state.probe_lease_secs)


def build_limits(state: State) -> LimitStore:
    """The tenants' limit store `[state]` asks for: this process's counters, or Redis's with
    this replica's share (`replicas_hint`) standing in while Redis is unreachable. A Redis one
    has `aclose()`."""
    if state.backend == "memory":
        return LocalLimits()
    try:
        from .redis_limits import RedisLimits
    except ImportError as exc:
        raise _no_redis(exc) from None
    return RedisLimits(state.url, **_redis_target(state), replicas_hint=state.replicas_hint)


class _RedisTarget(TypedDict):
    mode: Mode
    sentinels: list[tuple[str, int]]
    service: str
    key_prefix: str
    timeout_secs: float


def _redis_target(state: State) -> _RedisTarget:
    """Where a Redis store of `[state]` connects, and how long it waits: both stores alike."""
    return {
        "mode": state.mode,
        "sentinels": [address for a in state.sentinels if (address := sentinel_address(a))],
        "service": state.service,
        "key_prefix": state.key_prefix,
        "timeout_secs": state.timeout_ms / 1000,
    }


def _no_redis(exc: ImportError) -> StartupError:
    return StartupError(
        f'state.backend = "redis" needs the redis package: {install_hint("redis")} ({exc})'
    )


def _require_cluster_pubsub() -> None:
    from redis.asyncio.cluster import RedisCluster

    if not hasattr(RedisCluster, "pubsub"):  # asyncio cluster pub/sub came with redis-py 8.0
        raise StartupError(
            'state.mode = "cluster" needs redis-py >= 8.0 (its asyncio RedisCluster has no '
            "pub/sub before): pip install 'redis>=8'"
        )
