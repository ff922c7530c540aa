"""One mapping of the outbound client's failures: the same failure is the same exception,
whichever client met it.

Four ways switchyard calls upstream, each against a raw loopback peer that fails on purpose:
`make_http_client()` over the aiohttp pool and over httpx's own pool (the base install), the
forwarder's direct send through the aiohttp pool, and any other httpx client (one a team
passes in); the last two inside `map_exceptions()`, as the forwarder and the judge call them.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import sys
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import httpx
import pytest
from aiohttp.client_reqrep import ConnectionKey

from servers import raw_server, read_http_request
from switchyard_mw import errors
from switchyard_mw.clients.outbound import make_http_client, map_exceptions, pool_of
from switchyard_mw.context import RequestContext, current_var

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
Call = Callable[[str], Awaitable[bytes]]
READ_SECS = (
    0.3  # the read bound of the timeout cases: a peer that says nothing is waited on this long
)


async def refused(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    raise AssertionError("never reached: nothing listens")


async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await read_http_request(reader)
    await reader.read()  # until the client hangs up


async def silent_mid_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await read_http_request(reader)
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part")
    await writer.drain()
    await reader.read()


async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await read_http_request(reader)


async def hang_up_mid_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await read_http_request(reader)
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part")
    await writer.drain()


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST instead of a FIN, as a crashed peer or a middlebox does."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def reset_before_answering(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    await read_http_request(reader)
    reset(writer)


async def reset_mid_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await read_http_request(reader)
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part")
    await writer.drain()
    await asyncio.sleep(0.05)  # the part arrives first: the reset then cuts the body
    reset(writer)


async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await read_http_request(reader)
    writer.write(b"NOT HTTP AT ALL\r\n\r\n")
    await writer.drain()


FAILURES: list[tuple[Handler, type[errors.TransportError]]] = [
    (refused, errors.ConnectError),
    (silent, errors.ReadTimeout),
    (silent_mid_body, errors.ReadTimeout),
    (hang_up, errors.RemoteProtocolError),
    (hang_up_mid_body, errors.RemoteProtocolError),  # aiohttp: a ClientPayloadError
    (reset_before_answering, errors.ReadError),
    (reset_mid_body, errors.ReadError),  # aiohttp: a ClientPayloadError too
    (garbage, errors.RemoteProtocolError),
]


@pytest.fixture
def no_gateway_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """`make_http_client()` as the base install builds it: aiohttp's pool cannot be imported."""
    monkeypatch.setitem(sys.modules, "switchyard_mw.clients.aiohttp_pool", None)


@pytest.fixture(params=["aiohttp pool", "httpx pool", "direct pool send", "other httpx client"])
async def call(request: pytest.FixtureRequest) -> AsyncIterator[Call]:
    """POST to a URL and read the whole answer, the way one of the four callers does."""
    timeout = httpx.Timeout(5.0, read=READ_SECS)
    if request.param == "httpx pool":
        request.getfixturevalue("no_gateway_extra")
    if request.param in ("aiohttp pool", "httpx pool"):
        http = make_http_client()
        assert (pool_of(http) is None) == (request.param == "httpx pool")

        async def through_client(url: str) -> bytes:
            return (await http.post(url, content=b"{}", timeout=timeout)).content

        yield through_client
        await http.aclose()
    elif request.param == "direct pool send":
        http = make_http_client()
        pool = pool_of(http)
        assert pool is not None
        limits = aiohttp.ClientTimeout(total=None, sock_connect=5.0, sock_read=READ_SECS)

        async def direct(url: str) -> bytes:
            with map_exceptions():
                async with pool.session().post(url, data=b"{}", timeout=limits) as response:
                    return await response.read()

        yield direct
        await http.aclose()
    else:
        async with httpx.AsyncClient(timeout=timeout) as other:

            async def mapped(url: str) -> bytes:
                with map_exceptions():
                    async with other.stream("POST", url, content=b"{}") as response:
                        return await response.aread()

            yield mapped


@pytest.mark.parametrize(("peer", "expected"), FAILURES, ids=[h.__name__ for h, _ in FAILURES])
async def test_each_failure_is_the_same_switchyard_error_from_every_caller(
    call: Call, peer: Handler, expected: type[errors.TransportError]
) -> None:
    ctx = RequestContext()
    token = current_var.set(ctx)
    try:
        if peer is refused:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
                with pytest.raises(errors.SwitchyardError) as info:
                    await call(f"http://127.0.0.1:{s.getsockname()[1]}/")
        else:
            async with raw_server(peer) as (url, _):
                with pytest.raises(errors.SwitchyardError) as info:
                    await call(url)
    finally:
        current_var.reset(token)
    assert type(info.value) is expected
    assert ctx.transport_error is expected  # the cooling policy reads the attempt's failure here


def test_a_dns_or_os_failure_maps_alike_from_either_library() -> None:
    # Unit level: a live name lookup would leave loopback. Each as its library raises it.
    key = ConnectionKey("nowhere.invalid", 80, False, True, None, None, None, None)
    lookup = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    dns_failures: list[BaseException] = [
        aiohttp.ClientConnectorDNSError(key, lookup),
        httpx.ConnectError("[Errno -2] Name or service not known"),
        lookup,
        ConnectionRefusedError(111, "Connection refused"),
    ]
    for failure in dns_failures:
        with pytest.raises(errors.ConnectError), map_exceptions():
            raise failure
    with pytest.raises(errors.NetworkError) as info, map_exceptions():
        raise OSError(101, "Network is unreachable")
    assert type(info.value) is errors.NetworkError


def test_aiohttp_errors_httpx_aiohttp_misnamed_map_by_their_cause() -> None:
    # httpx-aiohttp's transport calls a refused connection a ConnectTimeout; the aiohttp
    # error it was raised from says what happened.
    key = ConnectionKey("127.0.0.1", 9, False, True, None, None, None, None)
    refusal = aiohttp.ClientConnectorError(key, ConnectionRefusedError(111, "refused"))
    with pytest.raises(errors.ConnectError), map_exceptions():
        raise httpx.ConnectTimeout("misnamed") from refusal


def test_what_is_not_a_transport_failure_passes_unchanged() -> None:
    for other in (ValueError("not ours to map"), httpx.DecodingError("bad gzip"), KeyError("k")):
        with pytest.raises(type(other)) as info, map_exceptions():
            raise other
        assert info.value is other
    mapped = errors.ReadTimeout("already mapped")
    with pytest.raises(errors.ReadTimeout) as again, map_exceptions(), map_exceptions():
        raise mapped
    assert again.value is mapped  # nested mappings leave a mapped error alone


async def test_our_own_timer_passes_unchanged() -> None:
    async def bounded() -> None:
        async with asyncio.timeout(0.01):
            with map_exceptions():
                await asyncio.sleep(5)  # cancelled by the timer: not a transport failure

    with pytest.raises(TimeoutError) as info:
        await bounded()
    assert not isinstance(info.value, errors.SwitchyardError)
