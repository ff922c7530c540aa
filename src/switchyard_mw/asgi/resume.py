"""Resumed streams over ASGI (`resume_streams`): the tap that watches a stream for its break,
and the continuation that carries it on.

The tap sits on both sides of the request's exchange (`Exchange.divert`). Above it, it reads
what the app sends, one whole SSE frame at a time (a frame cut between two messages waits for
its end): once content has reached the client, an error frame (the forwarder's event for an
upstream cut or reset, a provider's mid-stream error) or a clean end before the answer's stop
reason is a break, and an expiry of the attempt's deadline (idle, slow) is one too. What the
break would have sent is kept, and nothing more of that attempt goes on. The driver then asks
the machine for the continuation (`AttemptMachine.broke`): another account of the model that
takes a prefill, with the request plus the partial answer. Below the exchange, the tap then
takes the continuation's messages in place of the client: its start is swallowed (the client
has one), its events go through the wire's splice, and only a continuation that reached its
own last event ends the client's stream. Anything else (refused, failed, cut, expired, no
account to take it) ends it with the error event of the original break.
"""

from __future__ import annotations

import enum
import json
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from ..config import Server
from ..engine.answers import deadline_exceeded
from ..engine.machine import AttemptMachine, expiry_resumable
from ..engine.machine import Send as SendOn
from ..telemetry import logs
from ..telemetry import names as tm
from ..wire import Wire, stream_error_event
from ._types import Message, Send
from .resume_stream import (
    RESUMABLE_WIRES,
    SpliceReader,
    Transcript,
    continuation,
    enabled,
    frames_end,
    prefill_accounts,
    refusal,
    splice_for,
)

if TYPE_CHECKING:
    from ..context import RequestContext
    from .exchange import Exchange

_log = logging.getLogger("switchyard_mw.asgi.resume")

CUT = "cut"
"""How a stream broke when its upstream cut it (reset, error event, end without its last
event); an expiry names its phase (`idle`, `slow`)."""


class Mode(enum.Enum):
    """What the tap does with the request's messages."""

    WATCHING = "watching"
    """The stream goes to the client as it comes; a break is looked for."""
    BROKEN = "broken"
    """It broke: nothing more of that attempt goes to the client."""
    SPLICING = "splicing"
    """The continuation's events go to the client, spliced into its stream."""
    PASSING = "passing"
    """The tap changes nothing any more."""


class Result(enum.Enum):
    """How a resume ended (`switchyard.resumes`' `result`)."""

    RESUMED = "resumed"
    """The continuation reached its last event: the client has one whole answer."""
    REFUSED = "refused"
    """The continuation was answered with an error status (a prefill refused, any 4xx/5xx)."""
    FAILED = "failed"
    """The continuation broke too, expired, or ended without its last event."""
    UNAVAILABLE = "unavailable"
    """No other account of the model that takes a prefill could take it."""


def tap_for(ex: Exchange, machine: AttemptMachine) -> StreamTap | None:
    """A tap on `ex` when the request is a stream that may be resumed, else None."""
    ctx = ex.ctx
    if ctx is None or ctx.view is None or not ctx.view.stream:
        return None
    wire = ctx.wire
    grounds = machine.grounds
    if wire not in RESUMABLE_WIRES or not grounds.resumes_streams:
        return None
    return StreamTap(ex, ctx, wire, grounds.server)


class StreamTap:
    """Watches one stream for its break, and splices its continuation (the module's
    docstring)."""

    __slots__ = (
        "_cont_ok",
        "_reader",
        "_rest",
        "_status",
        "client",
        "ctx",
        "mode",
        "original",
        "reason",
        "server",
        "transcript",
        "wire",
    )

    def __init__(self, ex: Exchange, ctx: RequestContext, wire: Wire, server: Server) -> None:
        self.ctx, self.wire, self.server = ctx, wire, server
        self.mode = Mode.WATCHING
        self.transcript: Transcript | None = None  # the current attempt's, if a 2xx stream
        self._rest = b""  # a frame cut by a message's end, until the rest comes
        self.reason: str | None = None
        self.original = b""  # what the break would have sent: the client gets it on failure
        self._reader: SpliceReader | None = None
        self._cont_ok = False  # the continuation answered with a 2xx stream
        self._status: int | None = None  # the continuation's status
        self.client: Send = ex.divert(self)

    # --- above the exchange -------------------------------------------------------------

    def top(self, message: Message) -> Message | None:
        mode = self.mode
        if mode is Mode.BROKEN:
            return None
        if mode is not Mode.WATCHING:
            return message
        kind = message["type"]
        if kind == "http.response.start":
            ok = message["status"] < 300 and _is_sse(message)
            self.transcript = Transcript(self.wire) if ok else None
            self._rest = b""
            return message
        transcript = self.transcript
        if kind != "http.response.body" or transcript is None:
            return message
        body: bytes = message.get("body", b"")
        more = message.get("more_body", False)
        data = self._rest + body if self._rest else body
        end = frames_end(data) if more else len(data)
        whole, self._rest = data[:end], data[end:]
        at = transcript.feed(whole)
        if at is not None and self._resumable(transcript):
            self._break(CUT, whole[at:])
            return {**message, "body": whole[:at], "more_body": True} if at else None
        if not more and not transcript.ended and self._resumable(transcript):
            # A clean end without the stream's last event: cut all the same.
            message_ = "upstream stream ended before its last event"
            self._break(CUT, stream_error_event(self.wire, "upstream_error", message_))
            return {**message, "body": whole, "more_body": True} if whole else None
        if whole is body:
            return message
        return {**message, "body": whole}

    def expired(self, phase: str) -> bool:
        mode = self.mode
        if mode is Mode.SPLICING:
            return True  # the continuation ran out of time: the original break is the answer
        transcript = self.transcript
        if (
            mode is not Mode.WATCHING
            or not expiry_resumable(phase)
            or transcript is None
            or not self._resumable(transcript)
        ):
            return False
        error = deadline_exceeded(phase)
        self._break(phase, stream_error_event(self.wire, error.error_type, error.message))
        return True

    def _resumable(self, transcript: Transcript) -> bool:
        ctx = self.ctx
        account = ctx.account
        return (
            transcript.content
            and not transcript.said_done  # complete but for its last event: nothing to add
            and account is not None
            and not ctx.disconnected
            and enabled(account.spec, self.server)
            and refusal(self.wire, transcript.events) is None
        )

    def _break(self, reason: str, original: bytes) -> None:
        self.mode = Mode.BROKEN
        self.reason = reason
        self.original = original

    # --- below the exchange -------------------------------------------------------------

    async def deliver(self, message: Message) -> None:
        if self.mode is not Mode.SPLICING:
            return await self.client(message)
        kind = message["type"]
        if kind == "http.response.start":
            self._cont_ok = message["status"] < 300 and _is_sse(message)
            self._status = message["status"]
            return None  # the client has its start
        reader = self._reader
        if kind != "http.response.body" or not self._cont_ok or reader is None:
            return None
        out = reader.feed(message.get("body", b""))
        if not message.get("more_body", False) and reader.ended and not reader.failed:
            self.mode = Mode.PASSING
            return await self.client({"type": kind, "body": out, "more_body": False})
        if out:
            await self.client({"type": kind, "body": out, "more_body": True})
        return None

    def splice(self) -> None:
        """The continuation's messages go through the splice from now on."""
        transcript = self.transcript
        assert transcript is not None
        self._reader = SpliceReader(self.wire, splice_for(self.wire, transcript.events))
        self._cont_ok = False
        self._status = None
        self.mode = Mode.SPLICING

    def result(self) -> Result:
        if self.mode is Mode.PASSING:
            return Result.RESUMED
        if self._status is not None and self._status >= 400:
            return Result.REFUSED
        return Result.FAILED


def _is_sse(start: Message) -> bool:
    return any(
        name.lower() == b"content-type" and bytes(value).startswith(b"text/event-stream")
        for name, value in start.get("headers", ())
    )


async def resume_broken(
    ex: Exchange, machine: AttemptMachine, run: Callable[[SendOn], Awaitable[object]]
) -> None:
    """If the request's stream broke, continue it on another account (`run` runs the
    attempt), or end it with the error event of its break."""
    tap = ex.tap
    if not isinstance(tap, StreamTap) or tap.mode is not Mode.BROKEN:
        return
    ctx = ex.ctx
    assert ctx is not None
    transcript, reason = tap.transcript, tap.reason
    assert transcript is not None
    assert reason is not None
    model, broken = ctx.resolved_model or "", ctx.account.name if ctx.account else ""
    status, usage = ctx.response_status, _usage(ctx)
    grounds = machine.grounds
    allowed = prefill_accounts(grounds.accounts, model, tap.wire, grounds.routable)
    tm.resumed_bytes.record(transcript.sent_bytes, {tm.RESPONSE_MODEL: model, "reason": reason})
    action = machine.broke(reason, transcript.sent_bytes, allowed)
    result = Result.UNAVAILABLE
    if isinstance(action, SendOn):
        request = json.loads(ctx.body or b"{}")
        body = continuation(tap.wire, request, transcript.events)
        assert isinstance(body, dict)  # refusals were checked at the break
        ctx.replace_body(json.dumps(body, separators=(",", ":")).encode())
        tap.splice()
        try:
            await run(action)
        except Exception as exc:  # the continuation's failure ends the stream as it broke
            # The type only: an exception's text may quote the request or the reply.
            _log.warning(
                "resuming a stream on %s failed (%s)", action.lease.account, type(exc).__name__
            )
        result = tap.result()
    ctx.response_status = status  # the client's, whatever the continuation was answered
    tm.resumes.add(1, {tm.RESPONSE_MODEL: model, "reason": reason, "result": result.value})
    logs.stream_resumed(
        model=model,
        reason=reason,
        result=result.value,
        broken=broken,
        resumed_on=action.lease.account if isinstance(action, SendOn) else None,
        sent_bytes=transcript.sent_bytes,
    )
    if result is Result.RESUMED:
        _add_usage(ctx, usage)
        return
    tap.mode = Mode.PASSING
    if ctx.disconnected:
        return  # nobody to tell
    await ex.out({"type": "http.response.body", "body": tap.original, "more_body": True})
    await ex.out({"type": "http.response.body", "body": b"", "more_body": False})


_Usage = tuple[int | None, int | None, int | None, int | None]


def _usage(ctx: RequestContext) -> _Usage:
    return ctx.input_tokens, ctx.output_tokens, ctx.cache_read_tokens, ctx.cache_write_tokens


def _add_usage(ctx: RequestContext, first: _Usage) -> None:
    """Both attempts were billed: the request's usage is their sum."""
    second = _usage(ctx)
    both = [
        None if a is None and b is None else (a or 0) + (b or 0)
        for a, b in zip(first, second, strict=True)
    ]
    ctx.report_usage(
        input_tokens=both[0],
        output_tokens=both[1],
        cache_read_tokens=both[2],
        cache_write_tokens=both[3],
    )
