"""Operator views: small pure-ASGI apps to mount next to the gateway's own routes."""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import os
from collections.abc import Callable, Collection
from typing import Protocol, TypeAlias, TypeVar

import msgspec

from ..config import Config
from ..core.clock import Clock, monotonic
from ..core.pool import AccountStatus
from ..engine.tenancy import Tenancy
from ..engine.variants import Canaries
from ._types import ASGIApp, Receive, Scope, Send

_T = TypeVar("_T")
Follow: TypeAlias = _T | Callable[[], _T]
"""An object, or a function returning the one in force now (so a view follows a reload)."""


class AccountsHealth(Protocol):
    """What the accounts view reads of an engine's pool (`stack.pool`, `engine.pool`)."""

    def status(self) -> list[AccountStatus]: ...

    def holds_of(self, account: str) -> dict[str, float]: ...

    def pair_status(self, name: str) -> dict[str, AccountStatus]: ...


def _now(source: Follow[_T]) -> _T:
    return source() if callable(source) else source


class CoolingStatusApp:
    """Answers GET with each account's breaker state as JSON.

    `clock` must be the pool's. A cooling end is shown as seconds from now
    (`cooled_for_secs`), since the pool's monotonic time means nothing outside the process.
    The pool holds names and counters only, so no key can leak through this view.
    A class rather than a function, so Starlette's `Route` serves it as an ASGI app.
    """

    def __init__(self, pool: Follow[AccountsHealth], *, clock: Clock = monotonic) -> None:
        self._pool = pool
        self.clock = clock

    @property
    def pool(self) -> AccountsHealth:
        return _now(self._pool)

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
        pool = self.pool
        return [
            {
                "name": s.name,
                **_breaker(s, now),
                # Throttle holds, per model: seconds until each ends (a 429's retry time).
                "held_for_secs": {
                    model: round(max(0.0, until - now), 3)
                    for model, until in pool.holds_of(s.name).items()
                },
                # The models whose health differs from the account's (an account serving
                # several keeps their faults per model: 5xx, deadlines, resets).
                "models": {
                    model: _breaker(pair, now) for model, pair in pool.pair_status(s.name).items()
                },
            }
            for s in pool.status()
        ]


def _breaker(s: AccountStatus, now: float) -> dict[str, object]:
    """One breaker's state (an account's, or an (account, model) pair's) as JSON fields."""
    return {
        "state": s.state.value,
        "consecutive_faults": s.consecutive_faults,
        "cooled_for_secs": (
            None if s.cooled_until is None else round(max(0.0, s.cooled_until - now), 3)
        ),
        "current_cooldown_secs": s.current_cooldown_secs,
        # Why it is out of rotation: "credentials" (401/402/403) or "outage".
        "cause": None if s.cause is None else s.cause.value,
        "probe_in_flight": s.probe_in_flight,
        # Half-open with no probe out: the next attempt on it is the probe.
        "probe_due": s.probe_due,
    }


def cooling_status_app(pool: Follow[AccountsHealth], *, clock: Clock = monotonic) -> ASGIApp:
    """The operator view of `pool` as an ASGI app (see `CoolingStatusApp`); pass a function
    returning the pool (`lambda: stack.pool`) to follow reloads."""
    return CoolingStatusApp(pool, clock=clock)


class CanariesStatusApp:
    """Answers GET with each canary's configured split, its guard's window counts (attempts
    and faults per model) and the variants the guard tripped. No keys or user ids inside.
    `canaries` may be a function returning them (`lambda: stack.variant.canaries`), to
    follow reloads."""

    def __init__(self, canaries: Follow[Canaries]) -> None:
        self._canaries = canaries

    @property
    def canaries(self) -> Canaries:
        """The canaries shown now (the function's answer, when given one)."""
        return _now(self._canaries)

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


class TenantsStatusApp:
    """Answers GET with each tenant's limits as this process counts them: the amount, the
    window, the model (null: every model), used (reserved and settled), remaining and the
    seconds until the window resets; the deployment's own `[[limits]]` under `"limits"`.
    Tenant names only: no key, not even its digest. `tenancy` may be a function returning the
    one in force (`lambda: stack.tenancy`), to follow reloads; None: no `[tenants]`."""

    def __init__(self, tenancy: Follow[Tenancy | None]) -> None:
        self._tenancy = tenancy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        tenancy = _now(self._tenancy)
        shown = {} if tenancy is None else tenancy.status()
        deployment = shown.pop("", [])
        body = msgspec.json.encode({"tenants": shown, "limits": deployment})
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class HealthApp:
    """Answers GET with liveness, the process's open asyncio tasks and file descriptors, and
    its pid.

    The two counts let a soak test see that nothing piles up under load: after the traffic
    stops, both must come back to where they started. The pid names the worker that answered
    (under `--workers N`, a SIGHUP reloads the worker it is sent to); with `config` (a
    function returning the config in force), `config` is a short digest of it, so an operator
    sees which config each worker serves.
    """

    def __init__(self, *, config: Callable[[], Config] | None = None) -> None:
        self.config = config

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        answer: dict[str, object] = {
            "status": "ok",
            "tasks": len(asyncio.all_tasks()),
            "open_fds": _open_fds(),
            "pid": os.getpid(),
        }
        if self.config is not None:
            answer["config"] = config_digest(self.config())
        body = msgspec.json.encode(answer)
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


def config_digest(config: Config) -> str:
    """12 hex digits that change whenever anything in `config` does (no secret is in it)."""
    return hashlib.sha256(msgspec.json.encode(config)).hexdigest()[:12]


class ReloadApp:
    """Answers POST by reloading the config: 200 `{"result": "ok"}` when the new one is in
    force, 422 `{"result": "rejected", "problems": [...]}` (key paths) when the old one stays.

    `reload` is the stack's (`SwitchyardStack.reload`). Mount it behind `OperatorOnly`: a
    reload re-reads files and the environment, which no client of the gateway should trigger.
    """

    def __init__(self, reload: Callable[[], list[str]]) -> None:
        self.reload = reload

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope.get("method") != "POST":
            await _json(send, 405, {"error": "method not allowed"}, [(b"allow", b"POST")])
            return
        problems = self.reload()
        if problems:
            await _json(send, 422, {"result": "rejected", "problems": problems})
        else:
            await _json(send, 200, {"result": "ok"})


class OperatorOnly:
    """Lets through only requests from loopback (or from the addresses in `allow`); answers
    any other client 403. For the operator routes: who may see account health, canary
    counts and metrics, or reload the config.

    The address is the peer's as the server reports it (`scope["client"]`): behind a proxy on
    the same host every request is loopback, so keep these routes off what the proxy serves.
    A server on a unix socket reports none: filesystem permissions already decide who connects.
    """

    def __init__(self, app: ASGIApp, *, allow: Collection[str] = ()) -> None:
        self.app = app
        self.allow = frozenset(allow)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self.permitted(scope.get("client")):
            await _json(send, 403, {"error": "operator routes answer loopback clients only"})
            return
        await self.app(scope, receive, send)

    def permitted(self, client: tuple[str, int] | None) -> bool:
        """Whether a peer (`scope["client"]`) may call: loopback, an `allow`ed address,
        or no address at all (a unix socket)."""
        if client is None:
            return True
        host = client[0]
        if host in self.allow:
            return True
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        return address.is_loopback


async def _json(
    send: Send,
    status: int,
    content: dict[str, object],
    extra: list[tuple[bytes, bytes]] | None = None,
) -> None:
    body = msgspec.json.encode(content)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *(extra or []),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
