"""The ASGI apps the bench measures, importable by uvicorn (`--app-dir bench _apps:NAME`).

Each is built on first access (module `__getattr__`), so a process builds only the one it
serves. Environment: BENCH_CONFIG (a switchyard config, for `stacked` and `gateway`),
BENCH_UPSTREAM (the mock upstream's base URL, for the pass-throughs), BENCH_CLIENT (the
outbound client of `gateway`: `default` = `make_http_client()` as shipped, `httpx` = a plain
httpx pool, `httpx-aiohttp` = httpx over `httpx_aiohttp.AiohttpTransport`, `httpx2` = httpx2
standing in for httpx process-wide).
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    import httpx
    from starlette.applications import Starlette

    from switchyard_mw.asgi._types import ASGIApp, Message, Receive, Scope, Send

ROOT = Path(__file__).resolve().parents[1]
POOL = 256  # connections of every outbound pool (the shipped default)
CLIENT_KINDS = ("default", "httpx", "httpx-aiohttp", "httpx2")

_REPLY = b'{"id":"bare","type":"message","content":[{"type":"text","text":"ok"}]}'
_REPLY_HEADERS = [
    (b"content-type", b"application/json"),
    (b"content-length", str(len(_REPLY)).encode()),
]


async def bare(scope: Scope, receive: Receive, send: Send) -> None:
    """An app that reads the request and answers at once: the floor every row is compared to."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": _REPLY_HEADERS})
    await send({"type": "http.response.body", "body": _REPLY})


class _Fields(msgspec.Struct):
    model: str = ""
    max_tokens: int | None = None
    stream: bool = False


class MinimalMiddleware:
    """The least any body-reading policy middleware does: a reference floor, not a product.

    It reads the whole body, decodes the three fields the deadline and variant rules need,
    hands the app the same body through a replaying `receive` and adds one response header.
    No context, no deadline, no account, no telemetry: what a Python middleware costs before
    it decides anything. The stack's figures are read against it as well as the bare app.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._decode = msgspec.json.Decoder(_Fields).decode

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        chunks = []
        more = True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        header = (b"x-model", self._decode(body).model.encode())
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)

        await self.app(scope, replay, send_with_header)


def plain_httpx_client() -> httpx.AsyncClient:
    """The outbound client as `make_http_client()` built it before the transport choice."""
    import httpx

    limits = httpx.Limits(max_connections=POOL, max_keepalive_connections=POOL)
    return httpx.AsyncClient(limits=limits, timeout=None, trust_env=False)


def httpx_aiohttp_client() -> httpx.AsyncClient:
    import httpx
    from httpx_aiohttp import AiohttpTransport

    limits = httpx.Limits(max_connections=POOL, max_keepalive_connections=POOL)
    return httpx.AsyncClient(
        transport=AiohttpTransport(limits=limits, trust_env=False), timeout=None, trust_env=False
    )


def _client(kind: str) -> httpx.AsyncClient:
    """The outbound client of `kind` (see the module docstring)."""
    if kind == "httpx2":
        import httpx2

        httpx2.alias_httpx()  # from here on `import httpx` is httpx2, in every module
    if kind in ("httpx", "httpx2"):
        return plain_httpx_client()
    if kind == "httpx-aiohttp":
        return httpx_aiohttp_client()
    from switchyard_mw.clients.outbound import make_http_client

    return make_http_client()


def passthrough(kind: str) -> Starlette:
    """A bare Starlette pass-through (no policy at all) to BENCH_UPSTREAM with one shared client.

    `kind` is a client kind, `aiohttp` for a plain aiohttp ClientSession (the floor), or
    `aiohttp-read` for the necessary-work floor: the same that also reads the body once as
    switchyard must, with `read_request` (a malformed body gets a 400 as switchyard's), and
    sends it as the gateway's forwarder does (`upstream_body`: from 64 KiB on, the head and
    then the body as a view; the plain floor's `data=body` has aiohttp join head and body into
    a new buffer and asyncio copy what the socket did not take at once, two passes over a large
    body the gateway does not make, so the gateway could cost less than this floor).
    """
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    upstream = os.environ["BENCH_UPSTREAM"].rstrip("/")
    headers = {"content-type": "application/json", "authorization": "Bearer sk-upstream"}
    if kind in ("aiohttp", "aiohttp-read"):
        import aiohttp

        from switchyard_mw.gateway.upstream_body import upstream_body
        from switchyard_mw.wire import WIRE_PATHS, WireError, read_request

        session: list[aiohttp.ClientSession] = []
        validates = kind == "aiohttp-read"

        async def forward_aiohttp(request: Request) -> Response:
            if not session:  # built in the serving loop
                connector = aiohttp.TCPConnector(limit=POOL)
                session.append(aiohttp.ClientSession(connector=connector, auto_decompress=False))
            body = await request.body()
            if validates:
                try:
                    read_request(WIRE_PATHS[request.url.path], body)
                except WireError as exc:
                    return Response(exc.message, status_code=exc.status)
            sent = upstream_body(body) if validates else body
            async with session[0].post(
                upstream + request.url.path, data=sent, headers=headers
            ) as reply:
                data = await reply.read()
                media = reply.headers.get("content-type")
                return Response(data, status_code=reply.status, media_type=media)

        endpoint = forward_aiohttp
    else:
        client = _client(kind)

        async def forward_httpx(request: Request) -> Response:
            body = await request.body()
            reply = await client.post(upstream + request.url.path, content=body, headers=headers)
            media = reply.headers.get("content-type")
            return Response(reply.content, status_code=reply.status_code, media_type=media)

        endpoint = forward_httpx
    paths = ("/v1/messages", "/v1/chat/completions", "/v1/responses")
    return Starlette(routes=[Route(p, endpoint, methods=["POST"]) for p in paths])


def gateway(kind: str) -> Any:
    """`examples/starlette_app.py`'s app, its outbound client swapped for one of `kind`."""
    client = _client(kind)
    import switchyard_mw.clients.outbound

    def make(**_: Any) -> httpx.AsyncClient:
        return client

    if kind != "default":
        switchyard_mw.clients.outbound.make_http_client = make
    sys.path.insert(0, str(ROOT))
    # Imported by name, so that the type checker of bench/ does not follow into examples/.
    return importlib.import_module("examples.starlette_app").app


def stacked() -> Any:
    from switchyard_mw.asgi.stack import switchyard_stack

    return switchyard_stack(bare, config=os.environ["BENCH_CONFIG"])


def __getattr__(name: str) -> Any:
    client = os.environ.get("BENCH_CLIENT", "default")
    if name == "stacked_app":
        app = stacked()
    elif name == "minimal_app":
        app = MinimalMiddleware(bare)
    elif name == "passthrough_app":
        app = passthrough(client)
    elif name == "gateway_app":
        app = gateway(client)
    else:
        raise AttributeError(name)
    globals()[name] = app
    return app
