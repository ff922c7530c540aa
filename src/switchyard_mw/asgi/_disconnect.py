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
import threading
import time
import weakref
from collections import deque
from typing import Any, ClassVar

from ..context import RequestContext
from ._types import Message, Receive

WATCH_AFTER_SECS = 0.1
"""How long a request runs before its client is watched: a departure goes unseen for at most
about 1.5 times this (the sweeper looks twice as often).

Watching costs a task per request (about 50 µs of CPU with its timer, measured): a request
that waits this long mostly waits on the server's own queue when the server is saturated, and
a shorter wait would add that cost exactly then. A departure from an LLM call that runs for
seconds is still noticed within a few tenths of a second."""


LISTENER_GRACE_SECS = 0.25
"""How long an app that listens for a disconnect in a task of its own has, once told, to end
its work itself before the task serving the request is cancelled anyway.

Django listens so, and cancels its view only when that listener hears `http.disconnect`:
cancelling the request's task first would interrupt Django while it waits on both, and leave
the view running to its end. Django ends it within a few loop turns of the message; the grace
only delays an app that listens but then goes on regardless."""


def running_loop() -> asyncio.AbstractEventLoop:
    """`asyncio.get_running_loop()`, without its system call on every request.

    CPython's version checks the process id (`getpid()`, a system call since glibc 2.25; the
    costliest single line of the stack when served). A thread runs one loop at a time, and
    asyncio's loop records the thread running it (`_thread_id`, None once it stops), so the
    loop found last is still the running one when it records this thread. Loops without that
    record as asyncio's do (uvloop and other implementations) are always asked for afresh.
    """
    global _last_loop
    loop = _last_loop
    if loop is not None and getattr(loop, "_thread_id", None) == threading.get_ident():
        return loop
    running = asyncio.get_running_loop()
    # Only asyncio's own loops are known to keep that record this way.
    _last_loop = running if isinstance(running, asyncio.BaseEventLoop) else None
    return running


_last_loop: asyncio.BaseEventLoop | None = None


class Deferred:
    """Work a request starts only if it lasts `WATCH_AFTER_SECS` (see `defer`).

    It waits in a set of the loop's sweeper, one set per tick: joining is an add, leaving
    (`leave()`, when the request ends first) a discard, so a request that ended leaves
    nothing of itself behind. A queue that drops entries only when they come due would keep
    about 0.1 s worth of every request's state alive under load (tens of thousands of objects
    for the garbage collector to walk: measured, it doubled the stack's cost per request).
    """

    __slots__ = ("_tick",)

    _tick: set[Deferred] | None  # the sweeper's set it waits in; None once it left (or ran)

    @property
    def waiting(self) -> bool:
        return self._tick is not None

    def leave(self) -> None:
        """No start after all (the request ended, or started the work itself)."""
        tick = self._tick
        if tick is not None:
            self._tick = None
            tick.discard(self)

    def start(self) -> None:
        raise NotImplementedError


def defer(work: Deferred, loop: asyncio.AbstractEventLoop) -> None:
    """Have `work.start()` called once `WATCH_AFTER_SECS` (up to 1.5 times that) have passed,
    unless `work.leave()` was called before then. `loop` is the running loop (asking asyncio
    for it costs a system call, so callers pass theirs)."""
    sweeper = _Sweeper.last  # `_Sweeper.of`'s usual answer, without the call
    if sweeper is None or sweeper.loop is not loop or sweeper.task.done():
        sweeper = _Sweeper.of(loop)
    tick = sweeper.ticks[0]
    tick.add(work)
    work._tick = tick
    if sweeper.idle:
        sweeper.wake()


class DisconnectWatch(Deferred):
    """One request's watch, from the start of its body's read; `stop()` when its response is
    complete or its work has ended.

    While the body is read it is the read's timer too: one sweeper entry per request, not one
    for the read and one for the watch (each costs). Should the read outlast
    `WATCH_AFTER_SECS` (at once for a bound shorter than twice that), a timer cancels `owner`
    at `read_secs` after `started` (`fired` says it did). `read(ctx)` ends the read: watching
    for a disconnect starts when the sweeper's time comes, at once if it came during the read.
    """

    __slots__ = (
        "_ctx",
        "_due",
        "_gone",
        "_handle",
        "_listener",
        "_loop",
        "_owner",
        "_receive",
        "_sent",
        "_task",
        "fired",
        "until",
    )

    def __init__(
        self,
        receive: Receive,
        loop: asyncio.AbstractEventLoop,
        owner: asyncio.Task[Any] | None,
        read_secs: float | None = None,
        started: float = 0.0,
    ) -> None:
        """`read_secs`: the bound on the body's read (None: none); `started`: when the request
        began (`time.monotonic()`)."""
        self._ctx: RequestContext | None = None  # None while the body is read
        self._receive = receive
        self._loop = loop
        self._owner = owner  # the task serving the request: cancelled when the client leaves
        self._task: asyncio.Task[None] | None = None
        self._gone: asyncio.Event | None = None
        self._listener: asyncio.Task[Any] | None = None  # a task waiting in `replay` for the end
        self._sent = False  # `replay` gave the body
        self._due = False  # the sweeper's time came during the read
        self._handle: asyncio.TimerHandle | None = None
        self.fired = False
        self.until = None if read_secs is None else started + read_secs
        if read_secs is not None and read_secs <= 2 * WATCH_AFTER_SECS:
            self._handle = loop.call_later(read_secs, self._expire)
        defer(self, loop)

    @property
    def gone(self) -> asyncio.Event:
        """Set once the client has left (made on first use: most requests never ask)."""
        if self._gone is None:
            self._gone = asyncio.Event()
            if self._ctx is not None and self._ctx.disconnected:
                self._gone.set()
        return self._gone

    def read(self, ctx: RequestContext) -> None:
        """The body is whole in `ctx`: stop timing the read, watch from now on."""
        self._ctx = ctx
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._due:
            self.start()

    def start(self) -> None:
        if self._tick is not None:
            self.leave()
        if self._ctx is None:  # still reading: time the read from now (nobody else may read)
            self._due = True
            if self.until is not None and self._handle is None and not self.fired:
                left = max(self.until - time.monotonic(), 0.0)
                self._handle = self._loop.call_later(left, self._expire)
            return
        if self._task is None:
            self._task = self._loop.create_task(self._watch())

    def stop(self) -> None:
        if self._tick is not None:  # called twice per request: no call at all the second time
            self.leave()
        if self._task is not None:
            self._task.cancel()
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    async def replay(self) -> Message:
        """The app's `receive`: the (possibly rewritten) body once, then waits for a disconnect.

        The body is built when the app first asks, so every policy has decided the model by
        then. A failover makes a new one, so each attempt reads the whole body again.
        """
        if not self._sent:
            self._sent = True
            body = b"" if self._ctx is None else self._ctx.body_for_app()
            return {"type": "http.request", "body": body, "more_body": False}
        self.start()  # the app listens for a disconnect: watch from now on
        self._listener = asyncio.current_task(self._loop)
        try:
            await self.gone.wait()
        finally:
            self._listener = None
        return {"type": "http.disconnect"}

    def _expire(self) -> None:
        self._handle = None
        if self._ctx is None and self._owner is not None:
            self.fired = True
            self._owner.cancel("switchyard body read timeout")

    async def _watch(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                break
        if self._ctx is not None:
            self._ctx.disconnected = True
        self.gone.set()
        owner, listener = self._owner, self._listener
        if owner is None:
            return
        if listener is None or listener is owner:
            owner.cancel("client disconnected")
        else:  # the app hears it in a task of its own (Django): its turn to end its work
            self._handle = self._loop.call_later(
                LISTENER_GRACE_SECS, owner.cancel, "client disconnected"
            )


class _Sweeper:
    """Starts the deferred work of every request older than `WATCH_AFTER_SECS`; sleeps when idle."""

    _by_loop: ClassVar[weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Sweeper]] = (
        weakref.WeakKeyDictionary()
    )
    last: ClassVar[_Sweeper | None] = None  # the one asked for last: nearly always the loop's own

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        # Newest first: work joins ticks[0]; each tick shifts them, and what falls off the end
        # has waited between WATCH_AFTER_SECS and 1.5 times that.
        self.ticks: deque[set[Deferred]] = deque(set() for _ in range(_TICKS))
        self.idle = False
        self._wake = asyncio.Event()
        self.task = loop.create_task(self._run())

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> _Sweeper:
        """The sweeper of `loop`, started on first use (again if its task has ended)."""
        sweeper = cls.last
        if sweeper is not None and sweeper.loop is loop and not sweeper.task.done():
            return sweeper
        sweeper = cls._by_loop.get(loop)
        if sweeper is None or sweeper.task.done():
            sweeper = cls._by_loop[loop] = cls(loop)
        cls.last = sweeper
        return sweeper

    def wake(self) -> None:
        self.idle = False
        self._wake.set()

    async def _run(self) -> None:
        ticks = self.ticks
        while True:
            if not any(ticks):
                self._wake.clear()
                self.idle = True
                await self._wake.wait()
            await asyncio.sleep(WATCH_AFTER_SECS / 2)
            due = ticks.pop()
            ticks.appendleft(set())
            while due:
                work = due.pop()
                work._tick = None
                work.start()


_TICKS = 3  # a sweep every WATCH_AFTER_SECS / 2: work waits two to three of them
