"""`make_http_client()`: httpx's API and exceptions over the aiohttp pool it is built on.

A raw TCP server on loopback answers exactly what each test needs (or misbehaves on purpose).
"""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest

from servers import free_port, raw_server, read_http_request, serve_in_thread
from switchyard_mw.clients import outbound
from switchyard_mw.clients.outbound import make_http_client, map_exceptions, pool_of, timeout_for
from switchyard_mw.context import RequestContext
from switchyard_mw.testing import MockProvider


async def read_request(reader: asyncio.StreamReader) -> bytes:
    return (await read_http_request(reader))[1]


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), extra, body)


async def stall_forever(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await read_request(reader)
    await reader.read()  # until the client hangs up


async def test_keep_alive_reuses_one_connection() -> None:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            body = await read_request(reader)
            writer.write(ok(body))
            await writer.drain()

    async with raw_server(echo) as (url, connections), make_http_client() as http:
        for i in range(3):
            response = await http.post(url + "/v1/messages", content=b"hello %d" % i)
            assert response.status_code == 200
            assert response.content == b"hello %d" % i
    assert len(connections) == 1


@pytest.mark.parametrize("idle", [0.05, 0.6])
async def test_an_idle_connection_is_dropped_before_the_server_drops_it(
    idle: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            body = await read_request(reader)
            writer.write(ok(body))
            await writer.drain()

    # The expiry scaled down: a connection idle past it is not reused, one idle less is.
    monkeypatch.setattr(outbound, "IDLE_EXPIRY_SECS", 0.3)
    async with raw_server(echo) as (url, connections), make_http_client() as http:
        for i in range(2):
            await asyncio.sleep(idle if i else 0)
            assert (await http.post(url, content=b"x")).status_code == 200
    assert len(connections) == (1 if idle < 0.3 else 2)


def test_the_pool_expires_idle_connections_before_uvicorn_closes_them() -> None:
    # uvicorn closes a connection idle for its keep-alive timeout: a request the pool sends on
    # it at that moment would be reset (an account fault). The pool lets go first.
    import uvicorn

    assert uvicorn.Config(app="app:app").timeout_keep_alive > outbound.IDLE_EXPIRY_SECS


async def test_cookies_an_upstream_sets_are_not_sent_again() -> None:
    seen: list[bytes] = []

    async def set_cookie(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            seen.append(head)
            await reader.readexactly(2)
            writer.write(ok(b"{}", b"set-cookie: __cf_bm=abc; Path=/\r\n"))
            await writer.drain()

    async with raw_server(set_cookie) as (url, _), make_http_client() as http:
        # By name, as every provider is: aiohttp's own jar refuses cookies from an IP address.
        url = url.replace("127.0.0.1", "localhost")
        for _ in range(2):
            assert (await http.post(url, content=b"{}")).status_code == 200
        pool = pool_of(http)
        assert pool is not None
        for _ in range(2):  # the pool the Forwarder sends through directly
            async with pool.session().post(url, data=b"{}") as response:
                assert response.status == 200
        assert not http.cookies
    assert len(seen) == 4
    assert all(b"cookie" not in head.lower().replace(b"set-cookie", b"") for head in seen)


async def test_per_request_timeout_bounds_the_wait_for_headers() -> None:
    async with raw_server(stall_forever) as (url, _), make_http_client() as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post(url, content=b"{}", timeout=httpx.Timeout(0.2))


async def test_timeout_for_a_context_applies() -> None:
    ctx = RequestContext()
    ctx.deadline_at = ctx.started_at + 0.2
    async with raw_server(stall_forever) as (url, _), make_http_client() as http:
        with pytest.raises(httpx.TimeoutException):
            await http.post(url, content=b"{}", timeout=timeout_for(ctx))


async def test_read_timeout_applies_to_every_body_chunk_and_aiter_raw_streams() -> None:
    async def one_chunk_then_stall(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        writer.write(b"f\r\ndata: first\r\n\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with raw_server(one_chunk_then_stall) as (url, _), make_http_client() as http:
        request = http.build_request("POST", url, content=b"{}", timeout=httpx.Timeout(0.3))
        response = await http.send(request, stream=True)
        chunks: list[bytes] = []

        async def read_all() -> None:
            async for chunk in response.aiter_raw():
                chunks.append(chunk)  # the first chunk arrives before the stall

        with pytest.raises(httpx.ReadTimeout):
            await read_all()
        await response.aclose()
    assert b"".join(chunks) == b"data: first\r\n\r\n"


async def test_aiter_raw_yields_each_chunk_as_it_arrives() -> None:
    go_on = asyncio.Event()

    async def two_chunks(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n6\r\nfirst\n\r\n")
        await writer.drain()
        await go_on.wait()  # sent only once the client has the first chunk
        writer.write(b"7\r\nsecond\n\r\n0\r\n\r\n")
        await writer.drain()

    got = []
    async with (
        raw_server(two_chunks) as (url, _),
        make_http_client() as http,
        asyncio.timeout(10),
        http.stream("POST", url, content=b"{}") as response,
    ):
        async for chunk in response.aiter_raw():
            got.append(chunk)
            go_on.set()
    assert b"".join(got) == b"first\nsecond\n"
    assert got[0] == b"first\n"


async def test_aclose_mid_stream_hangs_up_and_the_pool_goes_on() -> None:
    hung_up = asyncio.Event()

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = await read_request(reader)
        if body == b"short":
            writer.write(ok(b"done"))
            await writer.drain()
            await reader.read()
            return
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        try:
            while True:
                writer.write(b"5\r\nchunk\r\n")
                await writer.drain()
                await asyncio.sleep(0.01)
        except ConnectionError:
            hung_up.set()

    async with raw_server(endless) as (url, connections), make_http_client() as http:
        response = await http.send(http.build_request("POST", url, content=b"{}"), stream=True)
        async for _ in response.aiter_raw():
            break
        await response.aclose()
        async with asyncio.timeout(10):
            await hung_up.wait()
        after = await http.post(url, content=b"short")
        assert after.content == b"done"
    assert len(connections) == 2  # the half-read connection was not reused


async def test_connection_refused_is_connect_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        async with make_http_client() as http:
            with pytest.raises(httpx.ConnectError):
                await http.post(f"http://127.0.0.1:{port}/", content=b"{}")


async def test_hang_up_before_answering_is_remote_protocol_error() -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)

    async with raw_server(hang_up) as (url, _), make_http_client() as http:
        with pytest.raises(httpx.RemoteProtocolError):
            await http.post(url, content=b"{}")


async def test_hang_up_mid_body_is_an_httpx_error() -> None:
    async def short_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part")
        await writer.drain()

    async with raw_server(short_body) as (url, _), make_http_client() as http:
        with pytest.raises(httpx.RemoteProtocolError):
            await http.post(url, content=b"{}")
        async with http.stream("POST", url, content=b"{}") as response:
            with pytest.raises(httpx.HTTPError):
                await response.aread()


async def test_malformed_status_line_is_remote_protocol_error() -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()

    async with raw_server(garbage) as (url, _), make_http_client() as http:
        with pytest.raises(httpx.RemoteProtocolError):
            await http.post(url, content=b"{}")


def test_one_client_serves_successive_event_loops() -> None:
    http = make_http_client()

    async def once() -> bytes:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_request(reader)
            writer.write(ok(b"hi"))
            await writer.drain()

        async with raw_server(answer) as (url, _):
            return (await http.post(url, content=b"{}")).content

    assert asyncio.run(once()) == b"hi"
    assert asyncio.run(once()) == b"hi"

    async def close() -> None:
        await http.aclose()

    asyncio.run(close())


async def test_a_client_we_built_exposes_its_pool_for_direct_sends() -> None:
    ours = make_http_client()
    theirs = httpx.AsyncClient()
    pool = pool_of(ours)
    assert pool is not None
    assert pool_of(theirs) is None  # someone else's client: the Forwarder uses its API
    provider = MockProvider()
    with serve_in_thread(provider) as url:
        session = pool.session()
        assert pool.session() is session  # one pool per loop, shared with the httpx API
        async with session.post(f"{url}/v1/messages", json={"model": "m", "messages": []}) as r:
            body = await r.read()
            status = r.status
        assert (await ours.post(f"{url}/v1/messages", json={"model": "m"})).status_code == 200
    assert status == 200
    assert b'"model":"m"' in body.replace(b" ", b"")
    await ours.aclose()
    await theirs.aclose()
    assert session.closed  # closing the client closes the pool it shares


async def test_errors_of_the_direct_pool_read_as_httpx_errors() -> None:
    pool = pool_of(make_http_client())
    assert pool is not None
    port = free_port()  # nothing listens there
    with pytest.raises(httpx.ConnectError), map_exceptions():
        await pool.session().post(f"http://127.0.0.1:{port}/v1/messages", data=b"{}")
    await pool.aclose()
