"""The aiohttp connection pool under `make_http_client()`'s httpx client (the `gateway` extra).

`bench/run.py` measured httpx's own pool at several times the CPU per proxied request, and
throughput falling as connections grow; this module is imported only where aiohttp is
installed, so the middlewares alone never load it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import NoReturn

import aiohttp
import httpx
from httpx_aiohttp import AiohttpTransport

from ..context import current_context


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
