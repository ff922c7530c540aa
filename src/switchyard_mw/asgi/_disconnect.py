"""Noticing a client that leaves, and cancelling the request's work when it does.

An app awaiting its upstream call does not read `receive`, so nobody else would notice: the
call would run to its end for a client that is gone. A watcher task reads `receive` for it —
but only once a request has lasted `WATCH_AFTER_SECS` (or the app asks `receive` itself): most
requests end sooner, and a task per request would be most of the stack's cost.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ..context import RequestContext
from ._types import Message, Receive

WATCH_AFTER_SECS = 0.02
"""How long a request runs before its client is watched: the longest a departure goes unseen."""


class DisconnectWatch:
    """One request's watch; `stop()` when its response is complete or its work has ended."""

    __slots__ = ("_ctx", "_handle", "_owner", "_receive", "_task", "gone")

    def __init__(self, ctx: RequestContext, receive: Receive) -> None:
        self._ctx = ctx
        self._receive = receive
        self._owner: asyncio.Task[Any] | None = asyncio.current_task()
        self._task: asyncio.Task[None] | None = None
        self.gone = asyncio.Event()
        loop = asyncio.get_running_loop()
        self._handle: asyncio.TimerHandle | None = loop.call_later(WATCH_AFTER_SECS, self.start)

    def start(self) -> None:
        if self._task is not None:
            return
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._task = asyncio.get_running_loop().create_task(self._watch())

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._task is not None:
            self._task.cancel()

    async def _watch(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                break
        self._ctx.disconnected = True
        self.gone.set()
        if self._owner is not None:
            self._owner.cancel("client disconnected")


def replay_receive(ctx: RequestContext, watch: DisconnectWatch) -> Receive:
    """A `receive` that yields the (possibly rewritten) body once, then waits for a disconnect.

    The body is built when the app first asks, so every policy has decided the model by then.
    A failover makes a new one, so each attempt reads the whole body again.
    """
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": ctx.body_for_app(), "more_body": False}
        watch.start()  # the app listens for a disconnect: watch from now on
        await watch.gone.wait()
        return {"type": "http.disconnect"}

    return replay
