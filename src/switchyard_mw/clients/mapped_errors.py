"""Transport failures of every upstream call, mapped to switchyard's `TransportError`s.

One mapping, `map_exceptions()` (as httpx's transport maps httpcore's), used by both pools
(`outbound.HttpxTransport`, `aiohttp_pool.PooledTransport`) and by every call switchyard makes
upstream: a transport failure comes out as the `switchyard_mw.errors.TransportError` of its
kind, which is also httpx's exception of that name, whichever library met it. Apart from
`outbound` so that the aiohttp pool and the client's builder need not import each other.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import AsyncIterator
from functools import cache
from types import TracebackType

import httpx

from .. import errors
from ..context import current_context


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
