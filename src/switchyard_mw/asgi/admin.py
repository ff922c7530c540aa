"""Operator views: small pure-ASGI apps to mount next to the gateway's own routes."""

from __future__ import annotations

import asyncio
import os

import msgspec

from ..core.clock import Clock, monotonic
from ..core.pool import AccountPool
from ..variant_assignment import Canaries
from ._types import ASGIApp, Receive, Scope, Send


class CoolingStatusApp:
    """Answers GET with each account's breaker state as JSON.

    `clock` must be the pool's. A cooling end is shown as seconds from now
    (`cooled_for_secs`), since the pool's monotonic time means nothing outside the process.
    The pool holds names and counters only, so no key can leak through this view.
    A class rather than a function, so Starlette's `Route` serves it as an ASGI app.
    """

    def __init__(self, pool: AccountPool, *, clock: Clock = monotonic) -> None:
        self.pool = pool
        self.clock = clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        headers = [(b"content-type", b"application/json")]
        if scope.get("method") in ("GET", "HEAD"):
            status, body = 200, msgspec.json.encode({"accounts": self.snapshot()})
        else:
            status, body = 405, b'{"error":"method not allowed"}'
            headers.append((b"allow", b"GET, HEAD"))
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        if scope.get("method") == "HEAD":
            body = b""
        await send({"type": "http.response.body", "body": body})

    def snapshot(self) -> list[dict[str, object]]:
        now = self.clock()
        return [
            {
                "name": s.name,
                "state": s.state.value,
                "consecutive_faults": s.consecutive_faults,
                "cooled_for_secs": (
                    None if s.cooled_until is None else round(max(0.0, s.cooled_until - now), 3)
                ),
                "current_cooldown_secs": s.current_cooldown_secs,
                "probe_in_flight": s.probe_in_flight,
                # Throttle holds, per model: seconds until each ends (a 429's retry time).
                "held_for_secs": {
                    model: round(max(0.0, until - now), 3)
                    for model, until in self.pool.holds_of(s.name).items()
                },
            }
            for s in self.pool.status()
        ]


def cooling_status_app(pool: AccountPool, *, clock: Clock = monotonic) -> ASGIApp:
    """The operator view of `pool` as an ASGI app (see `CoolingStatusApp`)."""
    return CoolingStatusApp(pool, clock=clock)


class CanariesStatusApp:
    """Answers GET with each canary's configured split, its guard's window counts (attempts
    and faults per model) and the variants the guard tripped. No keys or user ids inside."""

    def __init__(self, canaries: Canaries) -> None:
        self.canaries = canaries

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        body = msgspec.json.encode({"canaries": self.canaries.status()})
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class HealthApp:
    """Answers GET with liveness and the process's open asyncio tasks and file descriptors.

    The two counts let a soak test see that nothing piles up under load: after the traffic
    stops, both must come back to where they started.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        body = msgspec.json.encode(
            {"status": "ok", "tasks": len(asyncio.all_tasks()), "open_fds": _open_fds()}
        )
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _open_fds() -> int | None:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None  # not Linux: the count is simply unknown
