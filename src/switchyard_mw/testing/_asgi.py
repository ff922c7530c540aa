"""Plain-ASGI plumbing of the mock provider: types, body reading, disconnect watching."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping, Sequence
from typing import Any

import msgspec

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

JSON_TYPE = b"application/json"


async def read_body(receive: Receive) -> bytes | None:
    """The whole request body, or None when the client left before sending it."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def unless_disconnected(work: Coroutine[Any, Any, None], receive: Receive) -> None:
    """Run `work` until it finishes or the client goes away, whichever is first.

    Servers do not cancel an ASGI app when its client disconnects, so without this a
    stalled answer would outlive its connection for the whole stall. Call only once
    the request body has been read: from then on `receive` only reports disconnects.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnect(receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        # Also reached when the server cancels us: neither task may outlive the request.
        for pending in (task, watcher):
            pending.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if not task.cancelled():
        task.result()


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def lifespan(receive: Receive, send: Send) -> None:
    # Answered rather than ignored so uvicorn's default lifespan="auto" logs no error.
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def send_whole(
    send: Send,
    status: int,
    content_type: bytes,
    body: bytes,
    extra_headers: Sequence[tuple[bytes, bytes]] = (),
) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    headers.extend(extra_headers)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def send_json(send: Send, status: int, data: object) -> None:
    await send_whole(send, status, JSON_TYPE, msgspec.json.encode(data))


async def send_empty(send: Send) -> None:
    await send({"type": "http.response.start", "status": 204, "headers": []})
    await send({"type": "http.response.body", "body": b""})
