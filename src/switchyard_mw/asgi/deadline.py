"""DeadlineMiddleware: a total bound on every upstream attempt, growing with the output cap.

The bound is an alarm that cancels the app's own task (no task group: the app keeps its
ContextVars), as `asyncio.timeout` does but with no new timer per stream chunk, and from then
on the app's `receive` says `http.disconnect`. An app that listens for that in a task of its
own when the time comes (Django, which cancels its view only then) is told first and given
`LISTENER_GRACE_SECS` to end its work itself: cancelling the task first would leave the view
running. Either way the client gets the expiry's answer. A stream's
`send` moves it: the response must start within `timeout_secs`, and then every chunk re-arms
it for `stream_idle_secs`. It is the one timer that decides an expiry: the outbound call's own
bounds (the forwarder's, `timeout_for`'s) are none or set past it, so that every expiry is
answered and counted as `deadline_exceeded` with its phase, never as an upstream failure.
"""

from __future__ import annotations

import asyncio
import enum
import time
from typing import Any

from ..config import Server
from ..context import RequestContext
from ..engine.answers import DEADLINE_EXCEEDED, deadline_exceeded
from ..engine.attempts import Limits, Phase, deadline_secs, in_force
from ..engine.content_events import ContentWatch, watch_for
from ..engine.stream_bounds import ThroughputFloor, first_token_secs, floor_for
from ..errors import DeadlineExceededAfterStart as DeadlineExceededAfterStart
from ..telemetry import names as tm
from ..wire import StreamSequence, Wire, sequence_for, stream_error_event
from ._base import PolicyMiddleware, send_error
from ._disconnect import (
    LISTENER_GRACE_SECS,
    WATCH_AFTER_SECS,
    Deferred,
    defer,
    running_loop,
)
from ._types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["DEADLINE_EXCEEDED", "DeadlineExceededAfterStart", "DeadlineMiddleware"]


class DeadlineMiddleware(PolicyMiddleware):
    """Bounds the app's work on each request as the deadline rule says.

    The limits come from the account the cooling policy chose (`ctx.account`) when there is one,
    else from this middleware's own `timeout_secs`, `stream_idle_secs` and `default_max_tokens`.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        timeout_secs: float = 60.0,
        stream_idle_secs: float = 60.0,
        default_max_tokens: int | None = None,
        server: Server | None = None,
    ) -> None:
        super().__init__(app, server=server)
        if timeout_secs <= 0 or stream_idle_secs <= 0:
            raise ValueError("timeout_secs and stream_idle_secs must be > 0")
        self.timeout_secs = timeout_secs
        self.stream_idle_secs = stream_idle_secs
        self.default_max_tokens = default_max_tokens

    async def handle(self, ctx: RequestContext, scope: Scope, receive: Receive, send: Send) -> None:
        view = ctx.view
        if view is None:
            return await self.app(scope, receive, send)
        # The account's limits when the cooling policy chose one, else this policy's own.
        limits: Limits = self if ctx.account is None else ctx.account.spec
        first = deadline_secs(view, limits)
        now = time.monotonic()
        # A stream starts at its first content event: `first` is the sooner of its bounds on
        # the headers and on that event; once the headers came, the second is what is due.
        to_content = first_token_secs(limits) if view.stream else first
        ctx.attempt_deadline_secs = in_force(first, ctx.budget_at, now)
        # What an app's own call bounds (`timeout_for`, a backstop past the alarm) must not cut
        # a stream before its first content is due.
        ctx.deadline_at = now + max(first, to_content)
        loop = running_loop()
        task = asyncio.current_task(loop)
        assert task is not None  # an ASGI app runs in a task
        idle = limits.stream_idle_secs if view.stream else None
        ctx.stream_idle_secs = idle
        guard = _Guard(ctx, receive, send, loop, task, first, idle, now)
        guard.hold_start(watch_for(view.wire) if view.stream else None, limits, now + to_content)
        if view.stream and to_content <= first < limits.timeout_secs:
            guard.no_start_phase = Phase.FIRST_TOKEN
        try:
            await self.app(scope, guard.receive, guard.send)
        except asyncio.CancelledError:
            # Ours only if the alarm cancelled it and nobody else cancelled the task as well.
            if not guard.took_back_cancellation():
                raise
            await guard.answer_expiry(view.wire)
        else:
            if guard.fired:  # the app ended its work once told, or swallowed our cancellation
                await guard.ended_late(view.wire)
            else:
                await guard.release()
        finally:
            guard.cancel()


class Expiry(enum.Enum):
    """How far an alarm has gone in ending the app's work."""

    PENDING = "pending"
    """Its time has not come (or it was disarmed first)."""
    TOLD = "told"
    """The app's own listener heard `http.disconnect`; the task is cancelled if the app has not
    ended its work within `LISTENER_GRACE_SECS`."""
    CANCELLED = "cancelled"
    """The task running the app was cancelled."""


_MAX_CANCELS = 4
"""How often an alarm cancels a task that has not ended (`LISTENER_GRACE_SECS` apart): the
expiry's answer comes within about a second of the deadline, whatever the app waits on."""


class _Alarm(Deferred):
    """Cancels a task at `when` (loop time).

    No timer at first: most attempts end long before their deadline, and a timer per attempt
    would be a large share of the stack's cost. The alarm waits in the loop's sweeper
    (`defer`) and sets its timer once the attempt has lasted `WATCH_AFTER_SECS`; only a bound
    shorter than twice that gets its timer at once. Moving it later allocates nothing: when
    the old timer fires early it re-arms for the new time, so a stream's per-chunk re-arm
    stays cheap.
    """

    __slots__ = ("_cancels", "_handle", "_loop", "_task", "expiry", "when")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        task: asyncio.Task[Any],
        secs: float,
    ) -> None:
        """An alarm `secs` from now."""
        self._loop = loop
        self._task = task
        when = loop.time() + secs
        self.when: float | None = when
        self.expiry = Expiry.PENDING
        self._cancels = 0  # how often it cancelled the task
        self._handle: asyncio.TimerHandle | None = None
        self._tick = None
        if secs > 2 * WATCH_AFTER_SECS:
            defer(self, loop)
        else:
            self._handle = loop.call_at(when, self._check)

    @property
    def fired(self) -> bool:
        """Whether its time came (and it began ending the app's work)."""
        return self.expiry is not Expiry.PENDING

    def start(self) -> None:
        """Called by the sweeper: the attempt outlasted the wait, so set the timer now."""
        if self.when is not None and self._handle is None and not self.fired:
            self._handle = self._loop.call_at(self.when, self._check)

    def move(self, when: float) -> None:
        if self.fired:
            return
        if self.waiting and when - self._loop.time() <= 2 * WATCH_AFTER_SECS:
            self.leave()  # too soon for the sweeper to be in time
        if not self.waiting and (
            self._handle is None or (self.when is not None and when < self.when)
        ):
            if self._handle is not None:
                self._handle.cancel()
            self._handle = self._loop.call_at(when, self._check)
        self.when = when

    def cancel(self) -> None:
        self.when = None
        if self._tick is not None:  # called twice per attempt: no call at all the second time
            self.leave()
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _check(self) -> None:
        self._handle = None
        if self.when is None:
            return
        if self._loop.time() < self.when:
            self._handle = self._loop.call_at(self.when, self._check)
            return
        self._expire()

    def _expire(self) -> None:
        self._cancel_task()

    def _cancel_task(self) -> None:
        self._handle = None
        if self._task.done():
            return
        self.expiry = Expiry.CANCELLED
        self._cancels += 1
        self._task.cancel("switchyard deadline")
        if self._cancels < _MAX_CANCELS:
            # A cancellation ends one wait. Cleanup that waits on a thread takes one per wait
            # (Django with a sync view: its request-finished signal, then asgiref's join of the
            # view's thread), and the answer must not wait for the thread.
            self._handle = self._loop.call_later(LISTENER_GRACE_SECS, self._cancel_task)

    def took_back_cancellation(self) -> bool:
        """Whether the task's cancellation was this alarm's alone: then it is taken back
        (the task goes on to answer the expiry). Call once, where the cancellation arrived."""
        if self.expiry is not Expiry.CANCELLED:
            return False
        self.cancel()  # no further cancellation while the expiry is answered
        left = self._task.cancelling()
        for _ in range(self._cancels):
            left = self._task.uncancel()
        return left == 0


MAX_HELD_BYTES = 256 << 10
"""Held events before a stream's first content larger than this go on: no answer opens with
that much, and memory stays bounded."""


class _Guard(_Alarm):
    """One attempt's alarm and the `send` that moves it; per attempt, never shared.

    A successful response's start is held back until its first content (a stream's first
    content event, the body of any other answer), with the events before it: an expiry
    meanwhile is answered as if nothing had started, so the account's lack of content fails
    over like an attempt with no answer.
    """

    __slots__ = (
        "_complete",
        "_content_at",
        "_floor",
        "_held",
        "_held_size",
        "_holds",
        "_idle",
        "_limits",
        "_listener",
        "_sequence",
        "_slow_at",
        "_start",
        "_told",
        "_watch",
        "ctx",
        "no_start_phase",
        "raw_receive",
        "raw_send",
    )

    def __init__(
        self,
        ctx: RequestContext,
        receive: Receive,
        send: Send,
        loop: asyncio.AbstractEventLoop,
        task: asyncio.Task[Any],
        first: float,
        idle: float | None,
        now: float,
    ) -> None:
        """`first`: the bound until the response starts; `idle`: a stream's gap limit, re-armed
        by every chunk (None: not a stream); `now`: `time.monotonic()`."""
        self.ctx = ctx
        self.raw_receive = receive
        self.raw_send = send
        self._idle = idle
        self._start: Message | None = None  # the response's start, once sent
        # A Responses stream's error event follows the last event number that passed.
        self._sequence: StreamSequence | None = sequence_for(ctx.wire) if idle is not None else None
        self._complete = False  # the response's last message was sent
        self._listener: asyncio.Task[Any] | None = None  # another task waiting in `receive`
        self._told: asyncio.Task[Any] | None = None  # the listener we cancelled to tell it
        self._holds = False  # a successful start is held until the first content
        self._held: list[Message] | None = None  # the start and events held back
        self._held_size = 0
        self._watch: ContentWatch | None = None  # a stream's content events
        self._limits: object = None
        self._content_at = 0.0  # (monotonic) when a stream's first content is due
        self._floor: ThroughputFloor | None = None
        self._slow_at: float | None = None  # (monotonic) when the stream is slow unless more
        self.no_start_phase: str = Phase.HEADERS if idle is not None else Phase.TOTAL
        """The phase of an expiry before anything reached the client."""
        _Alarm.__init__(self, loop, task, self._bound(first, now))  # not super(): per attempt

    def _bound(self, secs: float, now: float) -> float:
        """`secs` from `now` (monotonic), or less when the request's budget ends sooner."""
        budget_at = self.ctx.budget_at
        if budget_at is not None and budget_at - now < secs:
            secs = max(budget_at - now, 0.0)
        return secs

    async def receive(self) -> Message:
        """The app's `receive`: `http.disconnect` once the deadline passed.

        A task other than the one serving the request that waits here (a framework's
        disconnect listener) is noted, so that the alarm can tell it: it is cancelled, and
        the cancellation is turned here into the `http.disconnect` it waits for.
        """
        if self.expiry is not Expiry.PENDING:
            return {"type": "http.disconnect"}
        task = asyncio.current_task(self._loop)
        if task is self._task:  # the app's own task: cancelling it reaches it anyway
            return await self.raw_receive()
        self._listener = task
        try:
            return await self.raw_receive()
        except asyncio.CancelledError:
            if task is None or self._told is not task or task.uncancel() > 0:
                raise  # not (only) ours: the app's own cancellation goes on
            return {"type": "http.disconnect"}
        finally:
            self._listener = None

    def _expire(self) -> None:
        listener = self._listener
        if listener is None or listener.done():
            self._cancel_task()
            return
        self.expiry = Expiry.TOLD
        self._told = listener
        listener.cancel("switchyard deadline")
        self._handle = self._loop.call_later(LISTENER_GRACE_SECS, self._cancel_task)

    def hold_start(self, watch: ContentWatch | None, limits: object, content_at: float) -> None:
        """Hold a successful response's start back until its first content: `watch` reads a
        stream's events (None: the first body is the content); `content_at` (monotonic): when
        a stream's first content is due; `limits`: the account's, for its throughput floor."""
        if self._idle is not None and watch is None:
            return  # a stream of a wire whose content events are unknown: as before
        self._holds = True
        self._watch = watch
        self._limits = limits
        self._content_at = content_at

    async def send(self, message: Message) -> None:
        held = self._held
        if held is not None:
            if self._watch is not None:
                return await self._hold(message)
            # A JSON answer: its start waits for the body's first bytes, and goes on with them
            # here (no coroutine more than the start's own send: this runs on every answer).
            if message["type"] != "http.response.body" or not (
                message.get("body") or not message.get("more_body", False)
            ):
                held.append(message)
                return
            self._held = None
            self._holds = False
            self._start = held[0]
            for early in held:
                await self.raw_send(early)
        kind = message["type"]
        if kind == "http.response.start":
            if self._holds and message["status"] < 300:
                self._held = [message]
                if self._idle is not None:  # a stream: its first content is now what is due
                    self.no_start_phase = Phase.FIRST_TOKEN
                    now = time.monotonic()
                    self.move(self._loop.time() + self._bound(self._content_at - now, now))
                return
            self._start = message
            if self._idle is not None:
                self._rearm(self._idle)
        elif kind == "http.response.body":
            if not message.get("more_body", False):
                self._complete = True
                self.cancel()
            elif self._idle is not None:
                body = message.get("body", b"")
                if self._floor is not None:
                    self._count(body)
                self._rearm(self._idle)
                if self._sequence is not None:
                    self._sequence.feed(body)
        await self.raw_send(message)

    async def _hold(self, message: Message) -> None:
        """Hold `message` with the start; pass all on once the first content came (or the
        answer ended, or outgrew what is held)."""
        held = self._held
        assert held is not None
        held.append(message)
        if message["type"] != "http.response.body":
            return
        body = message.get("body", b"")
        more = message.get("more_body", False)
        self._held_size += len(body)
        watch = self._watch
        content = bool(body) if watch is None else watch.feed(body)
        if content or not more or self._held_size > MAX_HELD_BYTES:
            await self._release(content)

    async def release(self) -> None:
        """The app returned with a response still held (it ended mid-answer): it goes on."""
        if self._held is not None and not self.fired:
            await self._release(False)

    async def _release(self, content: bool) -> None:
        held, self._held = self._held or [], None
        self._holds = False
        now = time.monotonic()
        ctx = self.ctx
        if content and self._watch is not None and ctx.first_token_at is None:
            ctx.first_token_at = now  # a stream's time to first token (not a JSON answer's)
        for message in held:
            await self.send(message)
        if content and self._watch is not None and not self._complete:
            self._floor = floor_for(self._limits, now)
            if self._floor is not None and self._idle is not None:
                self._count(b"")
                self._rearm(self._idle)  # the floor may bind before the next chunk comes

    def _count(self, body: bytes) -> None:
        """A stream's output so far, read against its throughput floor."""
        watch, floor = self._watch, self._floor
        assert watch is not None
        assert floor is not None
        if body:
            watch.feed(body)
        self._slow_at = floor.note(time.monotonic(), watch.output_tokens)

    def _rearm(self, secs: float) -> None:
        now = time.monotonic()
        if self._slow_at is not None and self._slow_at - now < secs:
            secs = max(self._slow_at - now, 0.0)  # the throughput floor binds first
        self.move(self._loop.time() + self._bound(secs, now))
        self.ctx.deadline_at = now + secs

    @property
    def _sse(self) -> bool:
        """Whether the response that started is an event stream."""
        headers = self._start.get("headers", ()) if self._start is not None else ()
        return any(
            name.lower() == b"content-type" and bytes(value).startswith(b"text/event-stream")
            for name, value in headers
        )

    def _phase(self) -> str:
        ctx = self.ctx
        now = time.monotonic()
        if ctx.budget_at is not None and now >= ctx.budget_at - 0.001:
            return "budget"
        if self._start is None:
            return self.no_start_phase
        if self._slow_at is not None and now >= self._slow_at - 0.001:
            return Phase.SLOW
        return "idle" if self._idle is not None else "total"

    async def ended_late(self, wire: Wire) -> None:
        """The app returned after the deadline passed: it ended its work once told (Django
        then returns without a response), or swallowed the cancellation. A response the app
        did not complete is answered as the expiry."""
        self.cancel()
        for _ in range(self._cancels):
            self._task.uncancel()
        if not self._complete:
            await self.answer_expiry(wire)

    async def answer_expiry(self, wire: Wire) -> None:
        phase = self._phase()
        self.ctx.deadline_phase = phase
        tm.deadline_exceeded.add(1, {"phase": phase})
        error = deadline_exceeded(phase)
        if self._start is None:
            await send_error(self.raw_send, wire, error.status, error.error_type, error.message)
        elif self._sse:
            event = stream_error_event(wire, error.error_type, error.message, self._sequence)
            await self.raw_send({"type": "http.response.body", "body": event, "more_body": True})
            await self.raw_send({"type": "http.response.body", "body": b"", "more_body": False})
        else:
            raise DeadlineExceededAfterStart(error.message)
