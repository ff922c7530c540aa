"""The one place outbound HTTP clients are built, so their transport can change in one place.

Used by the judge and by the example gateway; a team's own app gets the deadline for its
upstream call in one line: `client.post(..., timeout=timeout_for(current_context()))`.

The client is an `httpx.AsyncClient` (its API, its timeouts). With the `gateway` extra
installed it runs over an aiohttp connection pool (`aiohttp_pool`), which `bench/run.py`
measured at a fraction of httpx's own pool's CPU per proxied request; without it, over httpx's
own pool, with the same limits, errors and cookie rule.

Its failures, and those of every other call switchyard makes upstream, pass through one
mapping, `map_exceptions()` (as httpx's transport maps httpcore's): a transport failure comes
out as the `switchyard_mw.errors.TransportError` of its kind, which is also httpx's exception
of that name, whichever library met it.
"""

from __future__ import annotations

import socket
import sys
import time
import weakref
from collections.abc import AsyncIterator
from functools import cache
from http.cookiejar import CookieJar, DefaultCookiePolicy
from types import TracebackType
from typing import TYPE_CHECKING

import httpx

from .. import errors
from ..context import RequestContext, current_context

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


class MappedStream(httpx.AsyncByteStream):
    """A response body whose read failures go through `map_exceptions()`."""

    def __init__(self, inner: httpx.AsyncByteStream | httpx.SyncByteStream) -> None:
        assert isinstance(inner, httpx.AsyncByteStream)
        self._inner = inner

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with map_exceptions():
            async for chunk in self._inner:
                yield chunk

    async def aclose(self) -> None:
        with map_exceptions():
            await self._inner.aclose()


def map_exceptions(*, report: bool = True) -> ExceptionMap:
    """Turn what the outbound call raised in transport into switchyard's `TransportError`s.

    `with map_exceptions(): await client.post(...)` around every call switchyard makes
    upstream: aiohttp's errors, httpx's transport errors and a bare `OSError` each come out as
    the `errors.TransportError` of their kind (a `ConnectError` for a refused or unresolvable
    host, a `ReadTimeout` for a silent upstream, ...), also httpx's exception of that name.
    Anything else passes unchanged: cancellation, a timer's `TimeoutError` raised outside the
    block, errors already mapped (blocks nest freely), and what is not a transport failure.

    `report`: mark the request's current attempt as failed in transport
    (`ctx.transport_error`), as its upstream call; the app's framework may turn the error into
    an answer of its own (a 500) that the cooling policy must not take for the upstream's. Off
    for calls that are not the attempt's (the judge, a shadow).
    """
    return _REPORTING if report else _SILENT


class ExceptionMap:
    """What `map_exceptions()` returns: stateless, so one of each kind serves every call."""

    __slots__ = ("_report",)

    def __init__(self, *, report: bool = True) -> None:
        self._report = report

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if not isinstance(exc, Exception) or isinstance(exc, errors.SwitchyardError):
            return  # success, cancellation, or already mapped: unchanged
        source, twin = _twin(exc)
        if twin is None:
            return
        if self._report:
            ctx = current_context()
            if ctx is not None:
                ctx.transport_error = twin
        raise twin(str(source) or type(source).__name__, request=_request_of(exc)) from source


_REPORTING = ExceptionMap(report=True)
_SILENT = ExceptionMap(report=False)


def _twin(exc: Exception) -> tuple[BaseException, type[errors.TransportError] | None]:
    """The failure `exc` stands for, and its switchyard error (None: not a transport failure).

    httpx-aiohttp's transport translates aiohttp's errors into httpx's, naming some wrongly
    (a refused connection a `ConnectTimeout`); the aiohttp error it raised from decides.
    """
    cause = exc.__cause__
    if isinstance(exc, httpx.TransportError) and isinstance(cause, Exception):
        twin = _aiohttp_twin(cause)
        if twin is not None:
            return cause, twin
    twin = _aiohttp_twin(exc)
    if twin is not None:
        return exc, twin
    for cls in type(exc).__mro__:
        twin = _TWINS.get(cls)
        if twin is not None:
            return exc, twin
    return exc, None


_TWINS: dict[type[BaseException], type[errors.TransportError]] = {
    httpx.ConnectTimeout: errors.ConnectTimeout,
    httpx.ReadTimeout: errors.ReadTimeout,
    httpx.WriteTimeout: errors.WriteTimeout,
    httpx.PoolTimeout: errors.PoolTimeout,
    httpx.TimeoutException: errors.TimeoutException,
    httpx.ConnectError: errors.ConnectError,
    httpx.ReadError: errors.ReadError,
    httpx.WriteError: errors.WriteError,
    httpx.NetworkError: errors.NetworkError,
    httpx.LocalProtocolError: errors.LocalProtocolError,
    httpx.RemoteProtocolError: errors.RemoteProtocolError,
    httpx.ProtocolError: errors.ProtocolError,
    httpx.ProxyError: errors.ProxyError,
    httpx.UnsupportedProtocol: errors.UnsupportedProtocol,
    httpx.TransportError: errors.TransportError,
    # What a client may let through unwrapped, by the first class of its MRO found here.
    socket.gaierror: errors.ConnectError,
    ConnectionRefusedError: errors.ConnectError,
    OSError: errors.NetworkError,
}
"""httpx's transport errors (and the OS's) and switchyard's of the same kind."""


def _aiohttp_twin(exc: BaseException) -> type[errors.TransportError] | None:
    """The switchyard error for an aiohttp error; None for anything else."""
    aiohttp = sys.modules.get("aiohttp")  # not loaded: no aiohttp error can have been raised
    if aiohttp is None or not isinstance(exc, aiohttp.ClientError):
        return None
    if isinstance(exc, aiohttp.ClientPayloadError) and _reset(exc):
        return errors.ReadError  # as httpx calls a body cut by a reset
    twins = _aiohttp_twins()
    for cls in type(exc).__mro__:
        twin = twins.get(cls)
        if twin is not None:
            return twin
    return errors.TransportError  # not reached: aiohttp.ClientError is in the table


@cache
def _aiohttp_twins() -> dict[type[BaseException], type[errors.TransportError]]:
    """aiohttp's errors and switchyard's of the same kind, as httpx's pool would name them."""
    import aiohttp  # loaded already: an aiohttp error is being mapped

    return {
        aiohttp.ConnectionTimeoutError: errors.ConnectTimeout,
        aiohttp.ServerTimeoutError: errors.ReadTimeout,
        aiohttp.ClientProxyConnectionError: errors.ProxyError,
        aiohttp.ClientHttpProxyError: errors.ProxyError,
        aiohttp.ClientConnectorError: errors.ConnectError,  # DNS and TLS failures too
        aiohttp.ServerDisconnectedError: errors.RemoteProtocolError,
        aiohttp.ClientPayloadError: errors.RemoteProtocolError,  # the body ended short
        aiohttp.ClientResponseError: errors.RemoteProtocolError,
        aiohttp.NonHttpUrlClientError: errors.UnsupportedProtocol,
        aiohttp.InvalidURL: errors.UnsupportedProtocol,
        aiohttp.ClientConnectionError: errors.ReadError,
        aiohttp.ClientError: errors.TransportError,
    }


def _reset(exc: BaseException) -> bool:
    """Whether an aiohttp body error came of a reset connection, not of a clean close.

    aiohttp keeps the connection's error only in the message (`client_proto.connection_lost`
    appends its repr); httpx's pool raises a `ReadError` for it.
    """
    return "ConnectionResetError" in str(exc)


def _request_of(exc: BaseException) -> httpx.Request | None:
    """The httpx request an httpx error was raised for, if it has one."""
    if not isinstance(exc, httpx.RequestError):
        return None
    try:
        return exc.request
    except RuntimeError:  # httpx's way of saying it has none
        return None


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
