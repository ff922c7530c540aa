"""The request body as the forwarder hands it to aiohttp: a large one is written, not copied.

aiohttp (on the Python versions where it avoids the transport's `writelines`) joins the
request's head and its body into one new bytes object before the first write, and asyncio's
socket transport slices the bytes it could not send at once (a copy) before buffering them
(another). For a body of 1 MB that is up to three passes over its bytes and fresh pages from
the kernel on every request, where one write of the body itself does.
"""

from __future__ import annotations

from typing import Any

from aiohttp import payload
from aiohttp.abc import AbstractStreamWriter

WRITTEN_APART = 64 * 1024
"""From this size on the head goes out in a write of its own and the body as a view: below it
one write of head and body (one copy of a small body) costs less than a second send."""


class UpstreamBody(payload.BytesPayload):
    """A body past `WRITTEN_APART` bytes: the head sent first, then the body as a memoryview
    (asyncio slices a view of what the socket did not take at once without copying it)."""

    def __init__(self, value: bytes, *args: Any, **kwargs: Any) -> None:
        super().__init__(memoryview(value), *args, **kwargs)

    async def write_with_length(
        self, writer: AbstractStreamWriter, content_length: int | None
    ) -> None:
        # Alone: else the head is joined to the body in a new buffer. An aiohttp that writes
        # the head at once (before 3.12) has no such method and needs none.
        send_headers = getattr(writer, "send_headers", None)
        if send_headers is not None:
            send_headers()
        await super().write_with_length(writer, content_length)


def upstream_body(body: bytes) -> bytes | UpstreamBody:
    """What to pass aiohttp as `data=` for `body`."""
    return UpstreamBody(body) if len(body) >= WRITTEN_APART else body
