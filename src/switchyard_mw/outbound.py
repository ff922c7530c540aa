"""The one place outbound HTTP clients are built, so their transport can change in one place.

Used by the judge and by the example gateway; a team's own app gets the deadline for its
upstream call in one line: `client.post(..., timeout=timeout_for(current_context()))`.

The client is an `httpx.AsyncClient` (its API, its exceptions, its timeouts) over an aiohttp
connection pool (`httpx_aiohttp.AiohttpTransport`): `bench/run.py` measured httpx's own pool
at several times the CPU per proxied request, and throughput falling as connections grow.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import AsyncIterator
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import NoReturn

import aiohttp
import httpx
from httpx_aiohttp import AiohttpTransport

from .context import RequestContext, current_context

DEFAULT_MAX_CONNECTIONS = 256


def make_http_client(
    *, max_connections: int = DEFAULT_MAX_CONNECTIONS, base_url: str = ""
) -> httpx.AsyncClient:
    """A pooled async client for upstream calls; build one per process and reuse it.

    No timeout of its own: each call passes the deadline of its request (`timeout_for`). It
    keeps no cookies: what one upstream answer sets is never sent with another request.
    Build it anywhere (at import time too): its pool is made on first use, in the running loop.
    """
    limits = httpx.Limits(
        max_connections=max_connections, max_keepalive_connections=max_connections
    )
    transport = PooledTransport(limits=limits, trust_env=False)
    client = httpx.AsyncClient(
        base_url=base_url,
        transport=transport,
        timeout=None,
        trust_env=False,
        cookies=_no_cookies(),
    )
    _transports[client] = transport
    return client


_transports: weakref.WeakKeyDictionary[httpx.AsyncClient, PooledTransport] = (
    weakref.WeakKeyDictionary()
)


def pool_of(client: httpx.AsyncClient) -> PooledTransport | None:
    """The aiohttp pool under a client `make_http_client()` built; None for any other client.

    A proxy that only forwards can send through it directly (`PooledTransport.session()`):
    httpx's request and response objects do nothing for such a call and cost about half its
    CPU. Errors must then go through `as_httpx_error`, so callers still see httpx's.
    """
    return _transports.get(client)


def _no_cookies() -> CookieJar:
    """A jar that keeps no cookie: one client serves every user and every account, so a
    provider's `Set-Cookie` for one request must not ride along on all the others."""
    return CookieJar(policy=DefaultCookiePolicy(allowed_domains=[]))


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
    remaining = ctx.deadline if ctx is not None else None
    return default_secs if remaining is None else max(remaining, 0.001)


class PooledTransport(AiohttpTransport):
    """`AiohttpTransport` raising the httpx exception httpx's own transport would raise.

    - a refused or unresolvable connection is `ConnectError` (not `ConnectTimeout`), a server
      that hangs up before or while answering is `RemoteProtocolError`, a stalled read is
      `ReadTimeout`, and any other aiohttp error is an `httpx.TransportError`: callers that
      catch `httpx.HTTPError` catch them all, while reading the body too;
    - the per-request httpx timeout applies as httpx defines it: `connect` to connecting,
      `read` to every read (headers and each body chunk), `pool` to waiting for a connection;
    - a client first used in another event loop (tests, a server restarted in-process) gets
      a new pool there instead of an error from the old loop's;
    - its aiohttp session keeps no cookies either (see `make_http_client`).
    """

    _loop: asyncio.AbstractEventLoop | None = None

    def get_client(self) -> aiohttp.ClientSession:
        # The base's session, but with a jar that keeps nothing: aiohttp's own jar would keep
        # what a provider's answer sets (it refuses only IP addresses) and send it with every
        # later request, of any user, through httpx's API and the direct pool alike.
        limit = self.limits.max_connections
        connector = aiohttp.TCPConnector(
            limit=100 if limit is None else limit,  # aiohttp's default, where the base leaves it
            keepalive_timeout=self.limits.keepalive_expiry,
            ssl=self.ssl_context,
        )
        return aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar())

    def session(self) -> aiohttp.ClientSession:
        """The aiohttp session (the pool) of the running loop, made on first use there."""
        loop = asyncio.get_running_loop()
        client = self.client
        if self._loop is not loop or not isinstance(client, aiohttp.ClientSession) or client.closed:
            self.client = None  # else the base hands back the old loop's session
            client = self.client = self.get_client()
            self._loop = loop
        return client

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.session()  # the base then uses this loop's session
        try:
            response = await super().handle_async_request(request)
        except (aiohttp.ClientError, httpx.TransportError) as exc:
            as_httpx_error(exc)
        stream = response.stream
        assert isinstance(stream, httpx.AsyncByteStream)
        response.stream = _Body(stream)
        return response


class _Body(httpx.AsyncByteStream):
    """The response body, with aiohttp's errors raised as httpx's."""

    def __init__(self, inner: httpx.AsyncByteStream) -> None:
        self._inner = inner

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._inner:
                yield chunk
        except (aiohttp.ClientError, httpx.TransportError) as exc:
            as_httpx_error(exc)

    async def aclose(self) -> None:
        try:
            await self._inner.aclose()
        except (aiohttp.ClientError, httpx.TransportError) as exc:
            as_httpx_error(exc)


# Most specific first: the first class an error is an instance of decides.
_ERRORS: tuple[tuple[type[BaseException], type[httpx.TransportError]], ...] = (
    (aiohttp.ConnectionTimeoutError, httpx.ConnectTimeout),
    (aiohttp.ServerTimeoutError, httpx.ReadTimeout),
    (aiohttp.ClientProxyConnectionError, httpx.ProxyError),
    (aiohttp.ClientHttpProxyError, httpx.ProxyError),
    (aiohttp.ClientConnectorError, httpx.ConnectError),
    (aiohttp.ServerDisconnectedError, httpx.RemoteProtocolError),
    (aiohttp.ClientPayloadError, httpx.RemoteProtocolError),
    (aiohttp.ClientResponseError, httpx.RemoteProtocolError),
    (aiohttp.NonHttpUrlClientError, httpx.UnsupportedProtocol),
    (aiohttp.InvalidURL, httpx.UnsupportedProtocol),
    (aiohttp.ClientConnectionError, httpx.ReadError),
    (aiohttp.ClientError, httpx.TransportError),
)


def as_httpx_error(exc: Exception) -> NoReturn:
    """Raise the httpx error for `exc`: an aiohttp error, or the base transport's translation
    of one (which names some wrongly: a refused connection as a timeout)."""
    original = exc.__cause__ if isinstance(exc.__cause__, aiohttp.ClientError) else exc
    for aiohttp_type, httpx_type in _ERRORS:
        if isinstance(original, aiohttp_type):
            _note(httpx_type)
            raise httpx_type(str(original) or type(original).__name__) from original
    _note(type(exc))
    raise exc


def _note(error: type[BaseException]) -> None:
    """Mark the request's current attempt as failed in transport: the app's framework may
    turn the error into an answer of its own (a 500) that the cooling policy must not take
    for the upstream's."""
    ctx = current_context()
    if ctx is not None:
        ctx.transport_error = error
