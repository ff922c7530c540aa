"""Noticing a client that leaves, and cancelling the request's work when it does.

An app awaiting its upstream call does not read `receive`, so nobody else would notice: the
call would run to its end for a client that is gone. A watcher task reads `receive` for it —
but only once a request has lasted `WATCH_AFTER_SECS` (or the app asks `receive` itself): most
requests end sooner, and a task or even a timer per request would be most of the stack's cost.
One sweeper task per event loop starts the watchers of the requests that outlast that.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

from ..context import RequestContext
from ._types import Message, Receive

WATCH_AFTER_SECS = 0.02
"""How long a request runs before its client is watched: about the longest a departure goes
unseen (the sweeper looks twice as often)."""


class DisconnectWatch:
    """One request's watch; `stop()` when its response is complete or its work has ended."""

    __slots__ = ("__weakref__", "_ctx", "_owner", "_receive", "_sweeper", "_task", "gone")

    def __init__(self, ctx: RequestContext, receive: Receive) -> None:
        self._ctx = ctx
        self._receive = receive
        self._owner: asyncio.Task[Any] | None = asyncio.current_task()
        self._task: asyncio.Task[None] | None = None
        self.gone = asyncio.Event()
        self._sweeper: _Sweeper | None = _Sweeper.of(asyncio.get_running_loop())
        self._sweeper.add(self)

    def start(self) -> None:
        if self._task is not None:
            return
        self._leave_sweeper()
        self._task = asyncio.get_running_loop().create_task(self._watch())

    def stop(self) -> None:
        self._leave_sweeper()
        if self._task is not None:
            self._task.cancel()

    def _leave_sweeper(self) -> None:
        if self._sweeper is not None:
            self._sweeper.discard(self)
            self._sweeper = None

    async def _watch(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                break
        self._ctx.disconnected = True
        self.gone.set()
        if self._owner is not None:
            self._owner.cancel("client disconnected")


class _Sweeper:
    """Starts the watch of every request older than `WATCH_AFTER_SECS`; sleeps when idle."""

    _by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Sweeper] = (
        weakref.WeakKeyDictionary()
    )

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._watches: dict[DisconnectWatch, float] = {}  # insertion order is age order
        self._wake = asyncio.Event()
        self._task = loop.create_task(self._run())

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> _Sweeper:
        sweeper = cls._by_loop.get(loop)
        if sweeper is None or sweeper._task.done():
            sweeper = cls._by_loop[loop] = cls(loop)
        return sweeper

    def add(self, watch: DisconnectWatch) -> None:
        self._watches[watch] = self._loop.time()
        if not self._wake.is_set():
            self._wake.set()

    def discard(self, watch: DisconnectWatch) -> None:
        self._watches.pop(watch, None)

    async def _run(self) -> None:
        while True:
            if not self._watches:
                self._wake.clear()
                await self._wake.wait()
            await asyncio.sleep(WATCH_AFTER_SECS / 2)
            cutoff = self._loop.time() - WATCH_AFTER_SECS
            due = []
            for watch, since in self._watches.items():
                if since > cutoff:
                    break
                due.append(watch)
            for watch in due:
                watch.start()


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
