"""The one place outbound HTTP clients are built, so their transport can change in one place.

Used by the judge and by the example gateway; a team's own app gets the deadline for its
upstream call in one line: `client.post(..., timeout=timeout_for(current_context()))`.

The client is an `httpx.AsyncClient` (its API, its timeouts). With the `gateway` extra
installed it runs over an aiohttp connection pool (`aiohttp_pool`), which `bench/run.py`
measured at a fraction of httpx's own pool's CPU per proxied request; without it, over httpx's
own pool, with the same limits, errors and cookie rule.

Its failures, and those of every other call switchyard makes upstream, pass through one
mapping, `map_exceptions()` (`mapped_errors`, re-exported here).
"""

from __future__ import annotations

import time
import weakref
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import TYPE_CHECKING

import httpx

from ..context import RequestContext
from .mapped_errors import ExceptionMap as ExceptionMap  # importable here, as before
from .mapped_errors import MappedStream
from .mapped_errors import map_exceptions as map_exceptions

if TYPE_CHECKING:
    from .aiohttp_pool import PooledTransport

DEFAULT_MAX_CONNECTIONS = 256

IDLE_EXPIRY_SECS = 4.0
"""How long the pool keeps an idle upstream connection: below the 5 s after which uvicorn (the
server of vLLM and of many self-hosted model servers) closes one. Kept as long as the server,
a request sent at the moment the server closes the connection is reset, and that reset counts
as a fault of the account."""


def make_http_client(
    *, max_connections: int = DEFAULT_MAX_CONNECTIONS, base_url: str = ""
) -> httpx.AsyncClient:
    """A pooled async client for upstream calls; build one per process and reuse it.

    No timeout of its own: each call passes the deadline of its request (`timeout_for`). It
    keeps no cookies: what one upstream answer sets is never sent with another request.
    Build it anywhere (at import time too): its pool is made on first use, in the running loop.
    """
    limits = httpx.Limits(
        max_connections=max_connections,
        max_keepalive_connections=max_connections,
        keepalive_expiry=IDLE_EXPIRY_SECS,
    )
    transport: httpx.AsyncBaseTransport
    try:
        from .aiohttp_pool import PooledTransport
    except ImportError:  # no `gateway` extra: httpx's own pool, slower but the same contract
        pooled = None
        transport = HttpxTransport(limits=limits, trust_env=False)
    else:
        pooled = transport = PooledTransport(limits=limits, trust_env=False)
    client = httpx.AsyncClient(
        base_url=base_url,
        transport=transport,
        timeout=None,
        trust_env=False,
        cookies=_no_cookies(),
    )
    if pooled is not None:
        _transports[client] = pooled
    return client


_transports: weakref.WeakKeyDictionary[httpx.AsyncClient, PooledTransport] = (
    weakref.WeakKeyDictionary()
)


def pool_of(client: httpx.AsyncClient) -> PooledTransport | None:
    """The aiohttp pool under a client `make_http_client()` built; None for any other client.

    A proxy that only forwards can send through it directly (`PooledTransport.session()`):
    httpx's request and response objects do nothing for such a call and cost about half its
    CPU. Such a call must then run inside `map_exceptions()`, so callers see the same errors.
    None as well without the `gateway` extra (the client then runs on httpx's pool).
    """
    return _transports.get(client)


def _no_cookies() -> CookieJar:
    """A jar that keeps no cookie: one client serves every user and every account, so a
    provider's `Set-Cookie` for one request must not ride along on all the others."""
    return CookieJar(policy=DefaultCookiePolicy(allowed_domains=[]))


class HttpxTransport(httpx.AsyncHTTPTransport):
    """httpx's own pool (the base install's), its failures mapped as the aiohttp pool's are."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        with map_exceptions():
            response = await super().handle_async_request(request)
        response.stream = MappedStream(response.stream)
        return response


BACKSTOP_SECS = 1.0
"""How far past the deadline policy's own bound `timeout_for`'s bounds are set (see there)."""


def timeout_for(ctx: RequestContext | None, *, default_secs: float = 60.0) -> httpx.Timeout:
    """An httpx timeout for the request's upstream call, as the deadline rule bounds it.

    Connecting, sending and the wait for a pooled connection are bounded by what is left of
    the attempt's deadline (for a stream: of `timeout_secs`, until its response starts) and
    of the request's budget. Each read is too, except in a stream, where a read waits for the
    next chunk: there it is bounded by `stream_idle_secs` (and the budget). httpx counts the
    wait for the response's start as a read as well, so a stream's read bound is the larger
    of the two; an app that passes this to a streaming call never cuts a healthy stream.

    Under the deadline policy its alarm decides every expiry, so that the client and the
    metrics always see `deadline_exceeded` with its phase: these bounds are then only a
    backstop, set `BACKSTOP_SECS` past the policy's, where they never win a race against it.
    Without the policy they are the only bounds (`default_secs` when nothing else applies).
    """
    start = seconds_left(ctx, default_secs=default_secs)
    if ctx is None:
        return httpx.Timeout(start)
    read = start
    idle = ctx.stream_idle_secs
    if idle is not None:
        if ctx.budget_at is not None:
            idle = min(idle, max(ctx.budget_at - time.monotonic(), 0.001))
        read = max(start, idle)
    if ctx.deadline_at is not None:  # set by the deadline policy only: its alarm is armed
        start += BACKSTOP_SECS
        read += BACKSTOP_SECS
    return httpx.Timeout(start, read=read)


def seconds_left(ctx: RequestContext | None, *, default_secs: float = 60.0) -> float:
    """What is left of the attempt's deadline and the budget, in seconds (at least 1 ms)."""
    remaining = ctx.seconds_left if ctx is not None else None
    return default_secs if remaining is None else max(remaining, 0.001)
