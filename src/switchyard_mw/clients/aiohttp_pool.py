"""The aiohttp connection pool under `make_http_client()`'s httpx client (the `gateway` extra).

`bench/run.py` measured httpx's own pool at several times the CPU per proxied request, and
throughput falling as connections grow; this module is imported only where aiohttp is
installed, so the middlewares alone never load it.
"""

from __future__ import annotations

import asyncio

import aiohttp
import httpx
from httpx_aiohttp import AiohttpTransport

from .mapped_errors import MappedStream, map_exceptions


class PooledTransport(AiohttpTransport):
    """`AiohttpTransport` raising the exception httpx's own transport (`HttpxTransport`) would.

    - its failures, while reading the body too, go through `map_exceptions()`: a refused or
      unresolvable connection is `ConnectError` (not `ConnectTimeout`), a server that hangs up
      before or while answering is `RemoteProtocolError`, a stalled read is `ReadTimeout`, each
      a `switchyard_mw.errors.TransportError` and the httpx exception of its name;
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
        with map_exceptions():
            response = await super().handle_async_request(request)
        response.stream = MappedStream(response.stream)
        return response
