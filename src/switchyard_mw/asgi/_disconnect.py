"""Noticing a client that leaves, and cancelling the request's work when it does.

An app awaiting its upstream call does not read `receive`, so nobody else would notice: the
call would run to its end for a client that is gone. A watcher task reads `receive` for it —
but only once a request has lasted `WATCH_AFTER_SECS` (or the app asks `receive` itself): most
requests end sooner, and a task or even a timer per request would be most of the stack's cost.
One sweeper task per event loop starts the watchers of the requests that outlast that; the
deadline policy defers its alarms the same way (`defer`).
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any, Protocol

from ..context import RequestContext
from ._types import Message, Receive

WATCH_AFTER_SECS = 0.02
"""How long a request runs before its client is watched: about the longest a departure goes
unseen (the sweeper looks twice as often)."""


class Deferred(Protocol):
    """Work a request starts only if it lasts `WATCH_AFTER_SECS` (see `defer`)."""

    def start(self) -> None: ...


class DisconnectWatch:
    """One request's watch; `stop()` when its response is complete or its work has ended."""

    __slots__ = ("__weakref__", "_ctx", "_gone", "_owner", "_receive", "_sweeper", "_task")

    def __init__(self, ctx: RequestContext, receive: Receive) -> None:
        self._ctx = ctx
        self._receive = receive
        self._owner: asyncio.Task[Any] | None = asyncio.current_task()
        self._task: asyncio.Task[None] | None = None
        self._gone: asyncio.Event | None = None
        self._sweeper: _Sweeper | None = defer(self)

    @property
    def gone(self) -> asyncio.Event:
        """Set once the client has left (made on first use: most requests never ask)."""
        if self._gone is None:
            self._gone = asyncio.Event()
            if self._ctx.disconnected:
                self._gone.set()
        return self._gone

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


def defer(work: Deferred) -> _Sweeper:
    """Have `work.start()` called once `WATCH_AFTER_SECS` have passed, unless it leaves first
    (`_Sweeper.discard`). Costs a dict entry, not a timer or a task."""
    sweeper = _Sweeper.of(asyncio.get_running_loop())
    sweeper.add(work)
    return sweeper


class _Sweeper:
    """Starts the deferred work of every request older than `WATCH_AFTER_SECS`; sleeps when idle."""

    _by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Sweeper] = (
        weakref.WeakKeyDictionary()
    )
    _last: _Sweeper | None = None  # the one asked for last: nearly always the loop's own

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._waiting: dict[Deferred, float] = {}  # insertion order is age order
        self._wake = asyncio.Event()
        self._task = loop.create_task(self._run())

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> _Sweeper:
        last = cls._last
        if last is not None and last._loop is loop and not last._task.done():
            return last
        sweeper = cls._by_loop.get(loop)
        if sweeper is None or sweeper._task.done():
            sweeper = cls._by_loop[loop] = cls(loop)
        cls._last = sweeper
        return sweeper

    def add(self, work: Deferred) -> None:
        self._waiting[work] = self._loop.time()
        if not self._wake.is_set():
            self._wake.set()

    def discard(self, work: Deferred) -> None:
        self._waiting.pop(work, None)

    async def _run(self) -> None:
        while True:
            if not self._waiting:
                self._wake.clear()
                await self._wake.wait()
            await asyncio.sleep(WATCH_AFTER_SECS / 2)
            cutoff = self._loop.time() - WATCH_AFTER_SECS
            due = []
            for work, since in self._waiting.items():
                if since > cutoff:
                    break
                due.append(work)
            for work in due:
                self._waiting.pop(work, None)
                work.start()


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
