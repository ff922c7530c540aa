"""Reading an ASGI request body whole, bounded: shared by the middlewares and the forwarder."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from .errors import ClientDisconnected as ClientDisconnected  # its home before errors.py
from .wire import too_large

# ASGI's message and receive callable, typed loosely enough for Starlette, FastAPI and
# hand-written apps alike; asgi/_types.py takes them from here, so both say the same.
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]


async def read_body(receive: Receive, *, limit: int, first: Message | None = None) -> bytes:
    """The whole request body (`first`: its first message, already received); `WireError`
    413 past `limit` bytes."""
    chunks: list[bytes] = []
    size = 0
    while True:
        if first is not None:
            message, first = first, None
        else:
            message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
