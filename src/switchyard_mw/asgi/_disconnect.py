"""Work a request starts only if it lasts: the loop's sweeper, and the grace constants.

An app awaiting its upstream call does not read `receive`, so nobody else would notice a client
that leaves: the call would run to its end for a client that is gone. The request's exchange
(`exchange.py`) reads `receive` for it in a watcher task, but only once a request has lasted
`WATCH_AFTER_SECS` (or the app asks `receive` itself): most requests end sooner, and a task or
even a timer per request would be most of the stack's cost. One sweeper task per event loop
starts the deferred work (`defer`) of the requests that outlast that: the watcher, and the
timer of the attempt's deadline.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections import deque
from typing import ClassVar

from ..core.compiled import mypyc_attr

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


@mypyc_attr(allow_interpreted_subclasses=True)  # compiled, Python code may still subclass it
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
