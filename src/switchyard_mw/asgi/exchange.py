"""One request's exchange with the app: its `receive`, its `send`, and its one timer.

The first switchyard layer an LLM call meets builds one as the body starts to arrive, and every
policy of the request works through it (`exchange_of(scope)`):

- It is the request's one timer. It bounds the body's read, then watches for the client
  leaving, and carries each attempt's deadline: one entry in the loop's sweeper and at most
  one timer handle at a time, set only for a request that outlasts `WATCH_AFTER_SECS` or a
  bound shorter than twice that (most requests end sooner). It alone cancels the task serving
  the request, and records why, so a catch site asks it (`whose()`) rather than working it
  out again.
- It is the app's `receive`: the body (as the policies rewrote it) once per attempt, then
  `http.disconnect` once the client left or the attempt's deadline passed (an app that
  listens in a task of its own, as Django does, is told so and given `LISTENER_GRACE_SECS`).
- It is the app's `send`, one function for what four layers each wrapped before: a stream's
  deadline re-armed per chunk, the attempt's answer held back while the attempt machine says
  so, and the response's tracking (status, `x-switchyard-*` headers, first token, the span's
  attributes before the last message).
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

from ..context import RequestContext
from ..engine.answers import deadline_exceeded, exposed_headers
from ..engine.attempts import Phase, first_token
from ..engine.content_events import ContentWatch
from ..engine.machine import FORWARD, State, expiry_phase
from ..engine.stream_bounds import ThroughputFloor, floor_for
from ..engine.tenancy import with_limits
from ..errors import DeadlineExceededAfterStart
from ..telemetry import names as tm
from ..wire import StreamSequence, Wire, error_body, sequence_for, stream_error_event
from ._disconnect import LISTENER_GRACE_SECS, WATCH_AFTER_SECS, Deferred, defer
from ._types import Message, Receive, Scope, Send

if TYPE_CHECKING:
    from ..engine.machine import AttemptMachine

MAX_HELD_BYTES = 1 << 20
"""A held error body larger than this is forwarded: failover gives way to bounded memory."""

MAX_OPENING_BYTES = 256 << 10
"""Held events before a stream's first content larger than this go on: no answer opens with
that much, and memory stays bounded."""

EXCHANGE_KEY = "switchyard.exchange"
"""Where the request's exchange is kept in `scope["state"]`."""


def exchange_of(scope: Scope) -> Exchange | None:
    """The request's exchange (None: not an LLM call whose body switchyard read)."""
    state = scope.get("state")
    found: Exchange | None = None if state is None else state.get(EXCHANGE_KEY)
    return found


class Cause(enum.Enum):
    """Why the exchange cancelled the task serving the request."""

    READ_TIMEOUT = "read_timeout"
    """The body did not arrive within `body_read_timeout_secs`."""
    CLIENT_LEFT = "client_left"
    """The client disconnected: nobody waits for the answer."""
    DEADLINE = "deadline"
    """The attempt's deadline passed."""


class Stage(enum.Enum):
    """Where the request stands for its timer."""

    READING = "reading"
    """The body is being read: the timer bounds the read."""
    SERVING = "serving"
    """The body is whole: the timer watches for the client and carries the deadline."""
    ENDED = "ended"
    """The response is complete or the request's work ended: nothing more to watch."""


class Expiry(enum.Enum):
    """How far the attempt's deadline has gone in ending the app's work."""

    PENDING = "pending"
    """Its time has not come (or it was disarmed first)."""
    TOLD = "told"
    """The app's own listener heard `http.disconnect`; the task is cancelled if the app has not
    ended its work within `LISTENER_GRACE_SECS`."""
    CANCELLED = "cancelled"
    """The task running the app was cancelled."""


_MAX_CANCELS = 4
"""How often a deadline cancels a task that has not ended (`LISTENER_GRACE_SECS` apart): the
expiry's answer comes within about a second of the deadline, whatever the app waits on."""

# Read on every request: module constants, since Enum member access is slow on Python 3.11.
_READ_TIMEOUT, _CLIENT_LEFT, _DEADLINE = Cause.READ_TIMEOUT, Cause.CLIENT_LEFT, Cause.DEADLINE
_READING, _SERVING, _ENDED = Stage.READING, Stage.SERVING, Stage.ENDED
_PENDING, _TOLD, _CANCELLED = Expiry.PENDING, Expiry.TOLD, Expiry.CANCELLED
_SHORT = 2 * WATCH_AFTER_SECS  # a bound this short gets its timer at once
_TIMER_EARLY = 0.001
"""How much sooner than its time the deadline's timer may fire (asyncio runs a timer up to
its clock resolution early): a budget or throughput floor this close counts as reached."""
_DISCONNECT: Message = {"type": "http.disconnect"}
_FORWARDING_STATE = State.FORWARDING


class Exchange(Deferred):
    """One request's timer, `receive` and `send` (see the module's docstring).

    `receive`/`send`: the server's; `owner`: the task serving the request (None: nothing to
    cancel); `read_secs`: the bound on the body's read (None: none), from `started`
    (`time.monotonic()`). `read(ctx)` ends the read.
    """

    __slots__ = (
        "_asked",
        "_body_sent",
        "_cancels",
        "_cause",
        "_complete",
        "_content",
        "_content_at",
        "_content_watch",
        "_decided",
        "_due",
        "_floor",
        "_grace",
        "_handle",
        "_holds",
        "_idle",
        "_limits",
        "_listener",
        "_loop",
        "_machine",
        "_owner",
        "_pre",
        "_pre_size",
        "_receive",
        "_send",
        "_sequence",
        "_size",
        "_slow_at",
        "_start",
        "_start_held",
        "_until",
        "_wake",
        "_watcher",
        "_when",
        "ctx",
        "expiry",
        "expose",
        "finished",
        "first_token_sooner",
        "held",
        "held_whole",
        "last",
        "stage",
        "stream",
        "tap",
        "traced",
    )

    def __init__(
        self,
        receive: Receive,
        send: Send,
        loop: asyncio.AbstractEventLoop,
        owner: asyncio.Task[Any] | None,
        read_secs: float | None = None,
        started: float = 0.0,
    ) -> None:
        self.ctx: RequestContext | None = None  # None while the body is read
        self._receive = receive
        self._send = send
        self._loop = loop
        self._owner = owner
        self.stage = _READING
        self._until = None if read_secs is None else started + read_secs
        self._due = False  # the sweeper's time came during the read
        self._handle: asyncio.TimerHandle | None = None  # the read's bound, then the deadline
        self._grace: asyncio.TimerHandle | None = None  # a cancellation after a listener's grace
        self._watcher: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None  # set when a listener should hear a disconnect
        self._listener: asyncio.Task[Any] | None = None  # a task waiting in `receive`
        self._cause: Cause | None = None  # why the task was first cancelled, since `whose()`
        self._cancels = 0  # how often the task was cancelled, since `whose()`
        self._decided: Cause | None = None  # what `whose()` found last
        self.expose = False  # add the `x-switchyard-*` headers
        self.last: Callable[[], None] | None = None  # runs before the response's last message
        self._when: float | None = None  # the deadline (loop time); None: none armed
        self._idle: float | None = None  # a stream's gap limit (None: not a stream)
        self._sequence: StreamSequence | None = None
        # A stream starts at its first content event (a JSON answer: at its body's first
        # bytes): a successful start is held back until then, with the events before it.
        self._holds = False
        self._pre: list[Message] | None = None  # the start and events held until content
        self._pre_size = 0
        self._content_watch: ContentWatch | None = None  # a stream's content events
        self._limits: object = None  # the account's, for its throughput floor
        self._content_at = 0.0  # (monotonic) when a stream's first content is due
        self._floor: ThroughputFloor | None = None
        self._slow_at: float | None = None  # (monotonic) when the stream is slow unless more
        # What an expiry before the start went on means is the machine's to say
        # (`expiry_phase`): these are what it asks about the attempt's answer.
        self._start_held = False  # a successful start is held back for its first content
        self.first_token_sooner = False
        """A stream's first bound is its first-token bound (sooner than its time to start)."""
        self._content = False  # the machine heard of the answer's first content
        self.expiry = _PENDING
        self._machine: AttemptMachine | None = None  # the attempt's, when one may be held
        self._asked = False  # the machine was told the attempt's answer started
        self._body_sent = False
        self._start: Message | None = None  # the attempt's response start, as the app sent it
        self.held: list[Message] | None = None
        """The attempt's answer held back (None: none is)."""
        self._size = 0  # bytes held
        self.held_whole = False
        """Whether the held answer is whole (it can be swallowed for a failover)."""
        self.stream = False  # the request asks for a stream (its first token is noted)
        self._complete = False  # the app sent the attempt's last message
        self.finished = False  # the client has the whole response
        self.tap: Tap | None = None  # a resumable stream's (`divert`)
        self.traced = False
        """Whether spans are made for the request (`tm.tracing()`, asked once by its owner)."""
        if read_secs is not None and read_secs <= _SHORT:
            self._handle = loop.call_later(read_secs, self._check)
        defer(self, loop)

    # --- the timer --------------------------------------------------------------------------

    def read(self, ctx: RequestContext) -> None:
        """The body is whole in `ctx`: stop timing the read, watch from now on."""
        self.ctx = ctx
        self.stage = _SERVING
        self.stream = ctx.view is not None and ctx.view.stream
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._due:
            self.start()

    def start(self) -> None:
        """Called by the sweeper (or when the app listens): the request outlasted the wait."""
        if self._tick is not None:
            self.leave()
        stage = self.stage
        if stage is _READING:  # time the read from now (nobody else may read)
            self._due = True
            if self._until is not None and self._handle is None and self._cause is None:
                left = max(self._until - time.monotonic(), 0.0)
                self._handle = self._loop.call_later(left, self._check)
            return
        if stage is _ENDED:
            return
        if self._watcher is None:
            self._watcher = self._loop.create_task(self._watch())
        if self._when is not None and self._handle is None and self.expiry is _PENDING:
            self._handle = self._loop.call_at(self._when, self._check)

    def stop(self) -> None:
        """The response is complete, or the request's work ended: nothing more to watch.
        The app's after-work (background tasks) runs on undisturbed."""
        if self._tick is not None:  # called twice per request: no call at all the second time
            self.leave()
        self.stage = _ENDED
        self._when = None
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            # Let go of it: its cancellation's traceback holds this exchange, which would
            # otherwise hold the task back, a cycle only the garbage collector frees.
            watcher.cancel()
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None

    def _check(self) -> None:
        self._handle = None
        if self.stage is _READING:
            self._cancel(_READ_TIMEOUT, "switchyard body read timeout")
            return
        when = self._when
        if when is None or self.expiry is not _PENDING:
            return
        if self._loop.time() < when:  # moved later meanwhile
            self._handle = self._loop.call_at(when, self._check)
            return
        listener = self._listener
        if listener is None or listener.done() or listener is self._owner:
            self._cancel_for_deadline()
            return
        # The app hears it in a task of its own (Django): its turn to end its work.
        self.expiry = _TOLD
        self._tell()
        self._later(self._cancel_for_deadline)

    def _cancel_for_deadline(self) -> None:
        self._grace = None
        owner = self._owner
        if owner is None or owner.done() or self._when is None:
            return
        self.expiry = _CANCELLED
        self._cancel(_DEADLINE, "switchyard deadline")
        if self._cancels < _MAX_CANCELS:
            # A cancellation ends one wait. Cleanup that waits on a thread takes one per wait
            # (Django with a sync view: its request-finished signal, then asgiref's join of the
            # view's thread), and the answer must not wait for the thread.
            self._later(self._cancel_for_deadline)

    def _cancel_for_client(self) -> None:
        self._grace = None
        self._cancel(_CLIENT_LEFT, "client disconnected")

    def _later(self, cancel: Callable[[], None]) -> None:
        if self._grace is not None:
            self._grace.cancel()
        self._grace = self._loop.call_later(LISTENER_GRACE_SECS, cancel)

    def _cancel(self, cause: Cause, message: str) -> None:
        owner = self._owner
        if owner is None or owner.done():
            return
        if self._cause is None:
            self._cause = cause
        self._cancels += 1
        owner.cancel(message)

    def whose(self) -> Cause | None:
        """Whose the cancellation that reached the task serving the request was: the cause,
        when the exchange's cancellations were the only ones (they are taken back, and the
        task goes on to answer); None when anyone else cancelled it too (it goes on). Call it
        where the cancellation arrived; a caller further up gets the same answer."""
        cancels = self._cancels
        if cancels == 0:
            return self._decided
        self._cancels = 0
        cause, self._cause = self._cause, None
        owner = self._owner
        assert owner is not None  # only a task the exchange cancelled
        left = owner.cancelling()
        for _ in range(cancels):
            left = owner.uncancel()
        if cause is _DEADLINE:
            self.disarm()  # no further cancellation while the expiry is answered
        self._decided = cause if left == 0 else None
        return self._decided

    async def _watch(self) -> None:
        receive = self._receive
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
        if self.ctx is not None:
            self.ctx.disconnected = True
        self._tell()
        listener = self._listener
        if listener is None or listener is self._owner:
            self._cancel_for_client()
        else:  # the app hears it in a task of its own (Django): its turn to end its work
            self._later(self._cancel_for_client)

    def _tell(self) -> None:
        """A listener waiting in `receive` hears `http.disconnect` (one that comes later, too)."""
        if self._wake is None:
            self._wake = asyncio.Event()
        self._wake.set()

    # --- the attempt's deadline -------------------------------------------------------------

    def arm(
        self,
        secs: float,
        idle: float | None,
        now: float,
        content_at: float | None = None,
        watch: ContentWatch | None = None,
        limits: object = None,
    ) -> None:
        """The attempt's deadline: `secs` from `now` (`time.monotonic()`) until its response
        is whole (a stream: until it starts), cut to the request's budget; a stream's every
        chunk re-arms it for `idle`.

        With `content_at` (monotonic: when a stream's first content is due), a successful
        start is held back until the answer's first content: `watch` reads a stream's events
        (None: the first body is the content); `limits`: the account's, for its throughput
        floor. Both in one step, as every attempt arms them."""
        assert self.ctx is not None
        self._idle = idle
        self._sequence = sequence_for(self.ctx.wire) if idle is not None else None
        self.expiry = _PENDING
        self._holds = False
        self._pre = None
        self._pre_size = 0
        self._content_watch = self._floor = self._slow_at = None
        self._start_held = self.first_token_sooner = False
        budget_at = self.ctx.budget_at
        if budget_at is not None and budget_at - now < secs:
            secs = max(budget_at - now, 0.0)
        loop = self._loop
        self._when = when = loop.time() + secs
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        # The sweeper sets the timer of a request that outlasts its wait (`start`), unless
        # the bound is too short for that or the sweeper already passed.
        if secs <= _SHORT or (self._tick is None and self.stage is _SERVING):
            self._handle = loop.call_at(when, self._check)
        # A stream of a wire whose content events are unknown is not held: as before.
        if content_at is not None and (idle is None or watch is not None):
            self._holds = True
            self._content_watch = watch
            self._limits = limits
            self._content_at = content_at

    def content_due(self) -> None:
        """A stream's successful start came and is held elsewhere (a hedge's race): its first
        content is what is due now, as when the start is held here."""
        if self._holds and self._idle is not None:
            self._start_held = True
            now = time.monotonic()
            self.move(self._bound(self._content_at - now, now))

    def disarm(self) -> None:
        """No deadline any more (the attempt ended, or its response is whole)."""
        self._when = None
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._grace is not None and self.expiry is not _PENDING:
            self._grace.cancel()
            self._grace = None

    def move(self, bound: float) -> None:
        """The deadline `bound` seconds from now: a timer at once when it is short or the
        sweeper already passed, else the sweeper sets it (`start`)."""
        when = self._loop.time() + bound
        old = self._when
        self._when = when
        handle = self._handle
        if handle is None:
            if bound <= _SHORT or (self._tick is None and self.stage is _SERVING):
                self._handle = self._loop.call_at(when, self._check)
        elif old is not None and when < old:
            handle.cancel()
            self._handle = self._loop.call_at(when, self._check)
        # Later than the timer set: it re-arms for the new time when it fires.

    def _bound(self, secs: float, now: float) -> float:
        """`secs` from `now` (monotonic), or less when the request's budget ends sooner."""
        assert self.ctx is not None
        budget_at = self.ctx.budget_at
        if budget_at is not None and budget_at - now < secs:
            secs = max(budget_at - now, 0.0)
        return secs

    def _rearm(self, chunk: bytes | None = None) -> None:
        """A stream's gap bound (`_idle`) from now, or less where its throughput floor binds
        first; `chunk`: the piece that just passed, counted against the floor and read for
        its sequence number first."""
        if chunk is not None:
            if self._floor is not None:
                self._count(chunk)
            if self._sequence is not None:
                self._sequence.feed(chunk)
        secs = self._idle
        if self.expiry is not _PENDING or self._when is None:
            return
        assert secs is not None
        now = time.monotonic()
        if self._slow_at is not None and self._slow_at - now < secs:
            secs = max(self._slow_at - now, 0.0)  # the throughput floor binds first
        self.move(self._bound(secs, now))
        assert self.ctx is not None
        self.ctx.deadline_at = now + secs

    def phase(self) -> Phase:
        """The phase an expiry now ran out in: the machine's rule (`expiry_phase`) asked
        with what the response had got to."""
        ctx = self.ctx
        assert ctx is not None
        return expiry_phase(
            time.monotonic(),
            ctx.budget_at,
            stream=self._idle is not None,
            started=self._start is not None,
            early=_TIMER_EARLY,
            start_held=self._start_held,
            first_token_sooner=self.first_token_sooner,
            slow_at=self._slow_at,
        )

    async def run(self, app: Any, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the app for one attempt under the deadline `arm` set; its expiry is answered
        here (through the attempt's hold, so it may fail over)."""
        try:
            await app(scope, receive, send)
        except asyncio.CancelledError:
            if self.whose() is not _DEADLINE:
                raise
            await self.answer_expiry()
        else:
            if self.expiry is not _PENDING:
                # The app returned after the deadline passed: it ended its work once told
                # (Django then returns without a response), or swallowed the cancellation.
                self.whose()
                if not self._complete:
                    await self.answer_expiry()
            elif self._pre is not None:  # the app returned mid-answer: what it sent goes on
                await self._release(False)
        finally:
            if self._when is not None or self._grace is not None:
                self.disarm()

    async def answer_expiry(self) -> None:
        ctx = self.ctx
        assert ctx is not None
        assert ctx.wire is not None
        wire = ctx.wire
        phase = self.phase()
        ctx.deadline_phase = phase
        tm.deadline_exceeded.add(1, {"phase": phase})
        tap = self.tap
        if tap is not None and tap.expired(phase):
            return  # a stream to resume: its error event waits for the continuation's fate
        error = deadline_exceeded(phase)
        start = self._start
        if start is None:
            await send_error(self._hold_or_out, wire, error.status, error.error_type, error.message)
        elif _is_sse(start):
            event = stream_error_event(wire, error.error_type, error.message, self._sequence)
            await self._hold_or_out(
                {"type": "http.response.body", "body": event, "more_body": True}
            )
            await self._hold_or_out({"type": "http.response.body", "body": b"", "more_body": False})
        else:
            raise DeadlineExceededAfterStart(error.message)

    # --- receive ------------------------------------------------------------------------------

    async def receive(self) -> Message:
        """The app's `receive`: the (possibly rewritten) body once per attempt, then waits
        for the client to leave or the attempt's deadline to pass.

        The body is built when the app first asks, so every policy has decided the model by
        then; a failover's attempt reads the whole body again.
        """
        if not self._body_sent:
            self._body_sent = True
            body = b"" if self.ctx is None else self.ctx.body_for_app()
            return {"type": "http.request", "body": body, "more_body": False}
        if self.expiry is not _PENDING:
            return _DISCONNECT
        self.start()  # the app listens for a disconnect: watch from now on
        if self._wake is None:
            self._wake = asyncio.Event()
        self._listener = asyncio.current_task(self._loop)
        try:
            await self._wake.wait()
        finally:
            self._listener = None
        return _DISCONNECT

    # --- send ---------------------------------------------------------------------------------

    def attempt(self, machine: AttemptMachine | None) -> None:
        """A new attempt begins (`machine`: its answer may be held back as it says)."""
        self._machine = machine
        self._asked = False
        self._content = False
        self._body_sent = False
        self._start = None
        self.held = None
        self._size = 0
        self.held_whole = False
        self._complete = False
        self.finished = False
        self.expiry = _PENDING
        if self._wake is not None and not (self.ctx is not None and self.ctx.disconnected):
            self._wake = None  # the last attempt's deadline told its listener, not this one's

    def divert(self, tap: Tap) -> Send:
        """Let `tap` see what the app sends first (`Tap.top`) and take what goes to the client
        (`Tap.deliver`) from now on; returns the client's own `send`, for the tap to use."""
        self.tap = tap
        client, self._send = self._send, tap.deliver
        return client

    async def send(self, message: Message) -> None:
        """The app's `send`. The usual message, a body of an answer whose start went on, is
        passed on here in full: this runs on every chunk of every answer, so it makes no call
        it can do without. What is rarer has a name of its own: the tap's look first
        (`Tap.top`), the start held back until the first content (`_json_opening`,
        `_opening`), the start's way (`_starting`), an answer held for a failover (`_hold`)."""
        tap = self.tap
        if tap is not None:  # a resumable stream's: the tap sees the app's message first
            found = tap.top(message)
            if found is None:
                return
            message = found
        if self._pre is not None:  # the start is held back until the answer's first content
            early = (
                self._json_opening(message)
                if self._content_watch is None
                else await self._opening(message)  # a stream's: its events are read for it
            )
            if early is None:
                return
            # A JSON answer's first bytes: its start goes on first (and what came between).
            start = self._starting(early[0])
            if start is not None:
                await self._send(start)
            for held in early[1:]:
                await self._hold_or_out(held)
        if message["type"] != "http.response.body":  # a start, or an extension's (trailers)
            out = self._starting(message)
            return None if out is None else await self._send(out)
        more = message.get("more_body", False)
        if not more:
            self._complete = True  # its deadline ends: in `stop` below, or in `_hold`
        elif self._idle is not None:  # a stream's chunk: the gap to the next is bounded anew
            self._rearm(message.get("body", b""))
        if self.held is not None:
            return await self._hold(message)
        ctx = self.ctx
        assert ctx is not None
        if self.stream and ctx.first_token_at is None:
            first_token(ctx, message.get("body", b""))
        if not self._content and ctx.first_token_at is not None and self._machine is not None:
            self._first_content()
        if not more:
            self.finished = True
            self.stop()  # servers report a disconnect once a response is complete
            if self.last is not None:
                self.last()
        await self._send(message)

    def _starting(self, start: Message) -> Message | None:
        """The response's start: a successful one held back until the answer's first content
        when the attempt asks for that (`arm`), else noted and returned to go on (None: held
        with the attempt's answer; the machine is asked once per attempt). A message that is
        neither start nor body (an extension's, such as trailers) goes as the answer goes:
        held with it, else returned as it is. A plain call, not a coroutine: it runs on every
        answer, and only its caller sends."""
        if start["type"] != "http.response.start":
            if self.held is None:
                return start
            self.held.append(start)  # as `_hold` keeps it (no body bytes)
            return None
        if self._holds and start["status"] < 300:
            self._pre = [start]
            self._start_held = True
            if self._idle is not None:  # a stream: its first content is now what is due
                now = time.monotonic()
                self.move(self._bound(self._content_at - now, now))
            return None
        if self._start is None:
            self._start = start
            if self._idle is not None:
                self._rearm()
        held = self.held
        if held is not None:
            held.append(start)  # as `_hold` keeps it (a start adds no bytes)
            return None
        machine = self._machine
        if machine is not None and not self._asked:
            # Held while a failover is possible, and every 5xx until the app ends:
            # Starlette's and FastAPI's error middleware answer an escaping exception with
            # a 500 and then re-raise it, and a transport error is no upstream answer.
            self._asked = True
            if machine.started(start["status"], start.get("headers", ())) is not FORWARD:
                self.held = [start]
                return None
        return self._noted(start)

    def _json_opening(self, message: Message) -> list[Message] | None:
        """`message` while a JSON answer's start is held back for its first bytes: held with
        it (None) until a body with bytes (or the answer's end) comes; then what was held is
        returned, the start first, and `message` is the caller's to pass on (not sent through
        `send` again: this runs on every JSON answer)."""
        pre = self._pre
        assert pre is not None
        if message["type"] != "http.response.body" or not (
            message.get("body") or not message.get("more_body", False)
        ):
            pre.append(message)
            return None
        self._pre = None
        self._holds = False
        return pre

    async def _opening(self, message: Message) -> list[Message] | None:
        """`message` while a stream's start is held back for its first content event: held
        with it until that content comes, the answer ends, or what is held outgrows
        `MAX_OPENING_BYTES`; then the held messages go through `send` again. Always None
        (nothing is left for the caller to send), as `_json_opening` answers when it holds."""
        pre = self._pre
        assert pre is not None
        watch = self._content_watch
        assert watch is not None
        pre.append(message)
        if message["type"] != "http.response.body":
            return None
        body = message.get("body", b"")
        self._pre_size += len(body)
        content = watch.feed(body)
        if content or not message.get("more_body", False) or self._pre_size > MAX_OPENING_BYTES:
            await self._release(content)
        return None

    async def _release(self, content: bool) -> None:
        held, self._pre = self._pre or [], None
        self._holds = False
        now = time.monotonic()
        ctx = self.ctx
        assert ctx is not None
        if content and self._content_watch is not None and ctx.first_token_at is None:
            ctx.first_token_at = now  # a stream's time to first token (not a JSON answer's)
        tap, self.tap = self.tap, None  # it saw these messages as they came: not twice
        try:
            for message in held:
                await self.send(message)
        finally:
            self.tap = tap
        if content and self._content_watch is not None and not self._complete:
            self._floor = floor_for(self._limits, now)
            if self._floor is not None and self._idle is not None:
                self._count(b"")
                self._rearm()  # the floor may bind before the next chunk comes

    def _count(self, body: bytes) -> None:
        """A stream's output so far, read against its throughput floor."""
        watch, floor = self._content_watch, self._floor
        assert watch is not None
        assert floor is not None
        if body:
            watch.feed(body)
        self._slow_at = floor.note(time.monotonic(), watch.output_tokens)

    def _first_content(self) -> None:
        """The stream's first content event passed (`ctx.first_token_at` notes it): the
        machine hears of it as that content goes to the client."""
        machine, ctx = self._machine, self.ctx
        assert machine is not None
        assert ctx is not None
        # Asked once the first content passed (a JSON answer notes none: never).
        if ctx.first_token_at is not None and machine.state is _FORWARDING_STATE:
            self._content = True
            machine.first_content()

    async def _hold_or_out(self, message: Message) -> None:
        """`message` held with the attempt's answer, or on its way (one that is no body's:
        `_starting`)."""
        if message["type"] != "http.response.body":
            out = self._starting(message)
            if out is not None:
                await self._send(out)
            return
        if self.held is not None:
            return await self._hold(message)
        await self.out(message)

    async def _hold(self, message: Message) -> None:
        held = self.held
        assert held is not None
        held.append(message)
        if message["type"] == "http.response.body":
            self._size += len(message.get("body", b""))
            if not message.get("more_body", False):
                self.held_whole = True
                if self._complete and self._when is not None:
                    self.disarm()  # the app's answer is whole: its attempt's deadline ends
            elif self._size > MAX_HELD_BYTES:
                await self.flush()

    async def flush(self) -> None:
        """Stop holding: what was held goes on, and no failover can follow."""
        if self._machine is not None:
            self._machine.cannot_hold()
        held, self.held = self.held or [], None
        for message in held:
            await self.out(message)

    async def out(self, message: Message) -> None:
        """A message on its way to the client: noted (status, headers, first token) and sent."""
        ctx = self.ctx
        assert ctx is not None
        kind = message["type"]
        if kind == "http.response.start":
            message = self._noted(message)
        elif kind == "http.response.body":
            if self.stream and ctx.first_token_at is None:
                first_token(ctx, message.get("body", b""))
            if not self._content and ctx.first_token_at is not None and self._machine is not None:
                self._first_content()
            if not message.get("more_body", False):
                self.finished = True
                self.stop()  # servers report a disconnect once a response is complete
                if self.last is not None:
                    self.last()
        await self._send(message)

    def _noted(self, start: Message) -> Message:
        """The response's start as it goes to the client: its status noted, the
        `x-switchyard-*` headers added."""
        ctx = self.ctx
        assert ctx is not None
        ctx.response_status = start["status"]
        if ctx.limit_headers is not None:  # a tenant's: the account's own give way
            start = {**start, "headers": with_limits(start.get("headers", ()), ctx.limit_headers)}
        if self.expose and (extra := exposed_headers(ctx)):
            return {**start, "headers": [*start.get("headers", ()), *extra]}
        return start


class Tap(Protocol):
    """What sees a resumable stream's messages (`asgi.resume`): the app's before the exchange
    does, and what goes to the client in its place."""

    def top(self, message: Message) -> Message | None:
        """The app's `message` as the exchange is to see it (None: withheld)."""

    def expired(self, phase: str) -> bool:
        """The attempt's deadline ran out in `phase`: whether the tap takes its answer over."""

    async def deliver(self, message: Message) -> None:
        """`message` on its way to the client."""


def _is_sse(start: Message) -> bool:
    """Whether a response that started is an event stream."""
    return any(
        name.lower() == b"content-type" and bytes(value).startswith(b"text/event-stream")
        for name, value in start.get("headers", ())
    )


async def send_error(
    send: Send,
    wire: Wire,
    status: int,
    error_type: str,
    message: str,
    extra_headers: Iterable[tuple[bytes, bytes]] = (),
) -> None:
    """A complete JSON error response in the wire's format."""
    body = error_body(wire, error_type, message)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *extra_headers,
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
