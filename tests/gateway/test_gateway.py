"""`gateway.Forwarder` on the wire: what it sends upstream and what it relays back.

Both ways in (the ASGI endpoint and `forward`, a Starlette endpoint) and both kinds of client
(`make_http_client()`'s pool, sent to directly, and any other httpx client, used through its
API) must do the same; a raw TCP server on loopback records exactly what arrives upstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect
from starlette.routing import Route

from servers import raw_server, read_http_request
from switchyard_mw.accounts import build_accounts
from switchyard_mw.asgi.cooling import CoolingMiddleware
from switchyard_mw.asgi.stack import switchyard_stack
from switchyard_mw.clients.outbound import make_http_client
from switchyard_mw.config import parse_config
from switchyard_mw.gateway import WIRE_ROUTES, Forwarder
from switchyard_mw.telemetry import names as tm

KEY = "sk-account-0001"
CALLER_KEY = "sk-caller-0002"
ANSWER = b'{"id":"x","usage":{"input_tokens":3,"output_tokens":4}}'
MESSAGE = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, list[bytes]], Awaitable[None]]


@contextlib.asynccontextmanager
async def upstream(handler: Handler) -> AsyncIterator[tuple[str, list[bytes]]]:
    """A raw HTTP/1.1 server; yields its URL and the requests (head and body) it received."""
    seen: list[bytes] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await handler(reader, writer, seen)

    async with raw_server(on_connect) as (url, _connections):
        yield url, seen


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head, body = await read_http_request(reader)
    return head + body


async def answer_json(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: list[bytes]
) -> None:
    while True:
        seen.append(await read_request(reader))
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            b"X-Upstream: one\r\nx-upstream: two\r\nconnection: keep-alive\r\n"
            b"keep-alive: timeout=5\r\ndate: Thu, 01 Jan 2026 00:00:00 GMT\r\nserver: up\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(ANSWER), ANSWER)
        )
        await writer.drain()


def app_for(forwarder: Forwarder, entry: str) -> Starlette:
    endpoint: Any = forwarder if entry == "asgi" else forwarder.forward
    return Starlette(routes=[Route(p, endpoint, methods=["POST"]) for p in WIRE_ROUTES])


def client_of(kind: str) -> httpx.AsyncClient:
    return make_http_client() if kind == "pooled" else httpx.AsyncClient(timeout=None)


def config(url: str, auth: str, extra: str = "") -> str:
    return f"""
[llm_clients.a]
base_url = "{url}/"
api_key_env = "KEY"
auth = "{auth}"
models = ["m"]
{extra}
"""


@contextlib.asynccontextmanager
async def gateway(
    url: str, *, entry: str, kind: str, auth: str = "x-api-key", extra: str = ""
) -> AsyncIterator[httpx.AsyncClient]:
    http = client_of(kind)
    app = app_for(Forwarder(http), entry)
    stack = switchyard_stack(
        app, config=parse_config(config(url, auth, extra)), environ={"KEY": KEY}
    )
    transport = httpx.ASGITransport(app=stack)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw.test") as client:
        yield client
    await http.aclose()


def header_lines(request: bytes) -> list[tuple[str, str]]:
    head = request.split(b"\r\n\r\n", 1)[0].decode("latin-1")
    lines = head.split("\r\n")[1:]
    return [(k.strip().lower(), v.strip()) for k, v in (line.split(":", 1) for line in lines)]


ENTRIES = pytest.mark.parametrize("entry", ["asgi", "forward"])
KINDS = pytest.mark.parametrize("kind", ["pooled", "httpx"])


@ENTRIES
@KINDS
@pytest.mark.parametrize("traced", [True, False])
async def test_request_upstream_carries_the_accounts_key_and_the_callers_other_headers(
    entry: str, kind: str, traced: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not traced:
        monkeypatch.setattr(tm, "tracing", lambda: False)
    body = json.dumps(MESSAGE).encode()
    caller = {
        "x-api-key": CALLER_KEY,
        "authorization": f"Bearer {CALLER_KEY}",
        "proxy-authorization": "Basic abc",
        "accept-encoding": "gzip, br",
        "te": "trailers",
        "x-switchyard-cluster": "c1",
        "x-caller": "kept",
        "anthropic-version": "2023-06-01",
        "content-type": "application/json",
    }
    async with (
        upstream(answer_json) as (url, seen),
        gateway(url, entry=entry, kind=kind) as client,
    ):
        reply = await client.post("/v1/messages?beta=true&x=a%20b", content=body, headers=caller)
    assert reply.status_code == 200
    (request,) = seen
    assert request.startswith(b"POST /v1/messages?beta=true&x=a%20b HTTP/1.1\r\n")
    assert request.endswith(b"\r\n\r\n" + body)
    headers = header_lines(request)
    names = [name for name, _ in headers]
    assert ("x-api-key", KEY) in headers
    assert names.count("x-api-key") == 1
    assert "authorization" not in names
    assert "proxy-authorization" not in names
    assert "te" not in names
    assert "x-switchyard-cluster" not in names
    assert ("accept-encoding", "identity") in headers
    assert names.count("accept-encoding") == 1
    assert ("x-caller", "kept") in headers
    assert ("anthropic-version", "2023-06-01") in headers
    assert ("content-length", str(len(body))) in headers
    assert CALLER_KEY not in request.decode("latin-1")
    assert ("traceparent" in names) is traced


@ENTRIES
@KINDS
async def test_bearer_accounts_send_their_key_as_authorization(entry: str, kind: str) -> None:
    async with (
        upstream(answer_json) as (url, seen),
        gateway(url, entry=entry, kind=kind, auth="bearer") as client,
    ):
        reply = await client.post(
            "/v1/chat/completions", json=MESSAGE, headers={"authorization": f"Bearer {CALLER_KEY}"}
        )
    assert reply.status_code == 200
    headers = header_lines(seen[0])
    assert [v for k, v in headers if k == "authorization"] == [f"Bearer {KEY}"]
    assert "x-api-key" not in [k for k, _ in headers]
    assert seen[0].startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")


@ENTRIES
@KINDS
async def test_the_answer_is_relayed_with_its_headers_minus_hop_by_hop_ones(
    entry: str, kind: str
) -> None:
    async with (
        upstream(answer_json) as (url, _),
        gateway(url, entry=entry, kind=kind) as client,
    ):
        for _ in range(2):  # the second over the kept-alive connection
            reply = await client.post("/v1/messages", json=MESSAGE)
            assert reply.status_code == 200
            assert reply.content == ANSWER
            raw = [(k.decode().lower(), v.decode()) for k, v in reply.headers.raw]
            assert [v for k, v in raw if k == "x-upstream"] == ["one", "two"]  # duplicates kept
            assert [v for k, v in raw if k == "content-length"] == [str(len(ANSWER))]
            assert [v for k, v in raw if k == "content-type"] == ["application/json"]
            for dropped in ("connection", "keep-alive", "date", "server"):
                assert dropped not in [k for k, _ in raw]


@ENTRIES
@KINDS
async def test_an_upstream_error_status_is_relayed_as_it_came(entry: str, kind: str) -> None:
    error = b'{"type":"error","error":{"type":"invalid_request_error","message":"no"}}'

    async def bad_request(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: list[bytes]
    ) -> None:
        seen.append(await read_request(reader))
        writer.write(
            b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(error), error)
        )
        await writer.drain()

    async with (
        upstream(bad_request) as (url, _),
        gateway(url, entry=entry, kind=kind) as client,
    ):
        reply = await client.post("/v1/messages", json=MESSAGE)
    assert reply.status_code == 400
    assert reply.content == error


@ENTRIES
@KINDS
async def test_a_stream_is_relayed_event_by_event_and_ends_with_an_error_if_cut(
    entry: str, kind: str
) -> None:
    def chunk(data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data)

    async def dies_mid_event(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: list[bytes]
    ) -> None:
        seen.append(await read_request(reader))
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nx-upstream: s\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        writer.write(chunk(b"event: a\ndata: 1\n\nevent: b\nda"))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(chunk(b"ta: 2\n\nevent: c\ndata: par"))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.transport.abort()  # gone mid-event, the chunked body unfinished

    async with (
        upstream(dies_mid_event) as (url, _),
        gateway(url, entry=entry, kind=kind) as client,
    ):
        reply = await client.post("/v1/messages", json={**MESSAGE, "stream": True})
    assert reply.status_code == 200
    assert reply.headers["x-upstream"] == "s"
    assert reply.headers["content-type"] == "text/event-stream"
    events, error = reply.content.split(b"event: error\n")
    assert events == b"event: a\ndata: 1\n\nevent: b\ndata: 2\n\n"  # no half event
    assert b"upstream stream failed" in error


@ENTRIES
async def test_without_a_stack_the_answer_is_a_clear_500(entry: str) -> None:
    async with make_http_client() as http:
        app = app_for(Forwarder(http), entry)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw.test") as client:
            reply = await client.post("/v1/messages", json=MESSAGE)
    assert reply.status_code == 500
    assert reply.json()["error"]["type"] == "gateway_misconfigured"
    assert reply.headers["content-type"] == "application/json"


async def stall(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: list[bytes]
) -> None:
    seen.append(await read_request(reader))
    await reader.read()  # until the gateway hangs up


@ENTRIES
@KINDS
async def test_a_stalled_answer_ends_at_the_attempts_deadline(entry: str, kind: str) -> None:
    async with (
        upstream(stall) as (url, _),
        gateway(url, entry=entry, kind=kind, extra="timeout_secs = 0.2") as client,
        asyncio.timeout(20),  # a hang fails the test instead of stalling the suite
    ):
        reply = await client.post("/v1/messages", json=MESSAGE)
    assert reply.status_code == 504
    assert reply.json()["error"]["type"] == "deadline_exceeded"


@ENTRIES
@KINDS
async def test_without_the_deadline_policy_the_budget_still_bounds_the_call(
    entry: str, kind: str
) -> None:
    # The cooling policy alone: nothing cancels the call, its own timeouts must end it.
    async with upstream(stall) as (url, _):
        http = client_of(kind)
        accounts = build_accounts(parse_config(config(url, "x-api-key")), {"KEY": KEY})
        app = CoolingMiddleware(app_for(Forwarder(http), entry), accounts=accounts)
        transport = httpx.ASGITransport(app=app)
        async with (
            httpx.AsyncClient(transport=transport, base_url="http://gw.test") as client,
            asyncio.timeout(20),
        ):
            headers = {"x-switchyard-timeout-ms": "300"}
            # The call's own error (ReadTimeout) made Starlette answer 500 before re-raising
            # it: the policy drops that answer and says the attempt ran out of time.
            reply = await client.post("/v1/messages", json=MESSAGE, headers=headers)
        assert reply.status_code == 504
        assert reply.json()["error"]["type"] == "deadline_exceeded"
        await http.aclose()


def events_with_pauses(pause_secs: float, *, then_stall: bool = False) -> Handler:
    """An upstream streaming three events `pause_secs` apart (or one, then silence)."""

    async def handler(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: list[bytes]
    ) -> None:
        seen.append(await read_request(reader))
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        for n in range(1 if then_stall else 3):
            if n:
                await asyncio.sleep(pause_secs)
            writer.write(b"12\r\nevent: a\ndata: %d\n\n\r\n" % n)
            await writer.drain()
        if then_stall:
            await reader.read()  # until the gateway hangs up
            return
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    return handler


@ENTRIES
@KINDS
async def test_a_stream_pausing_longer_than_timeout_secs_runs_to_its_end(
    entry: str, kind: str
) -> None:
    # `timeout_secs` bounds only the wait for the stream's start; each pause is under the
    # idle limit, so nothing may cut it (the call's own read bound included).
    extra = "timeout_secs = 0.2\nstream_idle_secs = 3"
    async with (
        upstream(events_with_pauses(0.5)) as (url, _),
        gateway(url, entry=entry, kind=kind, extra=extra) as client,
        asyncio.timeout(20),
    ):
        reply = await client.post("/v1/messages", json={**MESSAGE, "stream": True})
    assert reply.status_code == 200
    assert reply.content == b"event: a\ndata: 0\n\nevent: a\ndata: 1\n\nevent: a\ndata: 2\n\n"


@ENTRIES
@KINDS
async def test_a_silent_stream_ends_with_deadline_exceeded_at_its_idle_limit(
    entry: str, kind: str
) -> None:
    # The idle limit far shorter than the first deadline would be for a non-stream: the
    # policy's alarm ends it, never the call's own read bound (that would say upstream_error).
    extra = "timeout_secs = 0.3\nstream_idle_secs = 0.3"
    async with (
        upstream(events_with_pauses(0.0, then_stall=True)) as (url, _),
        gateway(url, entry=entry, kind=kind, extra=extra) as client,
        asyncio.timeout(20),
    ):
        reply = await client.post("/v1/messages", json={**MESSAGE, "stream": True})
    assert reply.status_code == 200
    events, error = reply.content.split(b"event: error\n")
    assert events == b"event: a\ndata: 0\n\n"
    assert json.loads(error.removeprefix(b"data: "))["error"]["type"] == "deadline_exceeded"


@KINDS
async def test_a_send_failing_mid_stream_is_the_clients_departure(kind: str) -> None:
    # What a server of ASGI spec 2.4 does once the client has left: a send raises OSError.
    hung_up = asyncio.Event()

    async def endless(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: list[bytes]
    ) -> None:
        seen.append(await read_request(reader))
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        try:
            while True:
                writer.write(b"12\r\nevent: a\ndata: 1\n\n\r\n")
                await writer.drain()
                await asyncio.sleep(0.01)
        except ConnectionError:
            hung_up.set()

    body = json.dumps({**MESSAGE, "stream": True}).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/messages",
        "raw_path": b"/v1/messages",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"host", b"gw.test")],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }
    messages: list[dict[str, Any]] = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await asyncio.Event().wait()  # the server never says more
        raise AssertionError

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and sent:
            raise OSError("the client has gone")
        sent.append(message)

    async with upstream(endless) as (url, _):
        http = client_of(kind)
        app = app_for(Forwarder(http), "asgi")
        stack = switchyard_stack(
            app, config=parse_config(config(url, "x-api-key")), environ={"KEY": KEY}
        )
        async with asyncio.timeout(20):
            with pytest.raises(ClientDisconnect):
                await stack(scope, receive, send)
            await hung_up.wait()  # the upstream stream was closed at once, not left to run
        await http.aclose()
    assert [m["type"] for m in sent] == ["http.response.start"]
    assert stack.pool.status_of("a").consecutive_faults == 0  # nobody's fault


def _conversation_of(size: int) -> bytes:
    """A Messages body of exactly `size` bytes, non-ASCII text included."""
    body = json.dumps({**MESSAGE, "messages": [{"role": "user", "content": ""}]}).encode()
    fill = "caf\u00e9 \u2615 the lock file moved; ".encode()
    missing = size - len(body)
    text = (fill * (missing // len(fill) + 1))[:missing]
    while True:  # the cut may split a character: trim to whole ones, pad with ASCII
        try:
            text.decode()
            break
        except UnicodeDecodeError:
            text = text[:-1]
    text += b"x" * (missing - len(text))
    raw = body.replace(b'"content": ""', b'"content": "' + text + b'"')
    assert len(raw) == size
    return raw


@ENTRIES
@KINDS
@pytest.mark.parametrize("size", [65535, 65536, 65537, (1 << 20) + 3])
async def test_a_large_body_arrives_upstream_whole_and_the_connection_goes_on(
    entry: str, kind: str, size: int
) -> None:
    body = _conversation_of(size)
    async with (
        upstream(answer_json) as (url, seen),
        gateway(url, entry=entry, kind=kind) as client,
    ):
        for _ in range(2):  # the second on the same pooled connection: the framing held
            reply = await client.post(
                "/v1/messages", content=body, headers={"content-type": "application/json"}
            )
            assert reply.status_code == 200
            assert reply.content == ANSWER
    assert len(seen) == 2
    for request in seen:
        sent = request.split(b"\r\n\r\n", 1)[1]
        assert sent == body
        headers = header_lines(request)
        assert ("content-length", str(size)) in headers
        assert [v for k, v in headers if k == "content-type"] == ["application/json"]


def _in_pieces(app: Any, *, then_leave: bool) -> Any:
    """A middleware between the stack and the forwarder that hands the (replayed) body on in
    pieces of 7 bytes, or, `then_leave`, the first piece and then the client's leaving."""

    async def pieces(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await app(scope, receive, send)
        queued: list[dict[str, Any]] = []

        async def receive_piece() -> dict[str, Any]:
            if not queued:
                message = await receive()
                if message["type"] != "http.request":
                    return message
                body = message.get("body", b"")
                cut = [body[i : i + 7] for i in range(0, len(body), 7)] or [b""]
                queued.extend(
                    {"type": "http.request", "body": piece, "more_body": True} for piece in cut
                )
                queued[-1]["more_body"] = message.get("more_body", False)
                if then_leave:
                    del queued[1:]
                    queued.append({"type": "http.disconnect"})
            return queued.pop(0)

        await app(scope, receive_piece, send)

    return pieces


def _stack_in_pieces(http: Any, url: str, *, then_leave: bool) -> Any:
    """The stack around the forwarder, whose body reaches it in pieces (`_in_pieces`)."""
    app = _in_pieces(app_for(Forwarder(http), "asgi"), then_leave=then_leave)
    return switchyard_stack(
        app, config=parse_config(config(url, "x-api-key")), environ={"KEY": KEY}
    )


@KINDS
async def test_a_body_in_pieces_is_forwarded_whole(kind: str) -> None:
    body = json.dumps(MESSAGE).encode()
    async with upstream(answer_json) as (url, seen):
        http = client_of(kind)
        stack = _stack_in_pieces(http, url, then_leave=False)
        transport = httpx.ASGITransport(app=stack)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw.test") as client:
            reply = await client.post("/v1/messages", content=body)
        await http.aclose()
    assert reply.status_code == 200
    assert reply.content == ANSWER
    assert [request.split(b"\r\n\r\n", 1)[1] for request in seen] == [body]


@KINDS
async def test_a_client_that_leaves_mid_body_is_a_client_disconnect(kind: str) -> None:
    body = json.dumps(MESSAGE).encode()
    async with upstream(answer_json) as (url, seen):
        http = client_of(kind)
        stack = _stack_in_pieces(http, url, then_leave=True)
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/v1/messages",
            "raw_path": b"/v1/messages",
            "root_path": "",
            "query_string": b"",
            "headers": [(b"content-type", b"application/json")],
            "client": ("127.0.0.1", 50000),
            "server": ("127.0.0.1", 8000),
        }
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop()
            await asyncio.Event().wait()
            raise AssertionError

        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        with pytest.raises(ClientDisconnect):
            await stack(scope, receive, send)
        await http.aclose()
    assert seen == []  # nothing went upstream
    assert sent == []


@KINDS
async def test_each_call_goes_to_its_own_path_and_query(kind: str) -> None:
    """One forwarder, calls on two paths with and without a query string, in turns: each
    reaches the upstream on the path and with the query the client asked for."""
    body = json.dumps(MESSAGE).encode()
    asked = [
        "/v1/messages",
        "/v1/messages?beta=true",
        "/v1/messages/count_tokens",
        "/v1/messages",
        "/v1/messages/count_tokens?x=a%20b",
    ]
    async with (
        upstream(answer_json) as (url, seen),
        gateway(url, entry="asgi", kind=kind) as client,
    ):
        for target in asked:
            reply = await client.post(target, content=body)
            assert reply.status_code == 200
    assert [request.split(b" ", 2)[1].decode() for request in seen] == asked
