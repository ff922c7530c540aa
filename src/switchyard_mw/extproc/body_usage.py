"""Which reader an answer's body needs for its token usage, decompressing it where needed.

A front that sees an answer's headers before its body (the ext_proc processor) asks `plan()`
how to read it: an event stream piece by piece, a JSON answer whole when it is short enough to
be held, else piece by piece with only its tail kept (`engine.usage`). A body sent with
`content-encoding: gzip` or `deflate` is decompressed as it passes, by the standard library's
zlib, at most `DECODED_MAX` bytes of it and a bounded multiple of each piece: past that, or on
data that does not decompress, reading stops and the answer counts as unread. Encodings zlib
cannot undo (`br`, `zstd`, several stacked) are not read either. Every answer that had usage
to read and was not read adds one to `switchyard.usage.unread` {model, account, reason}, so a
dashboard shows the hole in the token counts instead of hiding it.
"""

from __future__ import annotations

import enum
import zlib
from collections.abc import Mapping
from typing import NamedTuple, Protocol

from ..context import RequestContext
from ..engine.usage import AnswerUsage, StreamUsage, Tokens
from ..telemetry import names as tm
from ..wire import Wire

WHOLE_ANSWER_MAX = 512 << 10
"""The longest JSON answer (as sent: compressed, if it is) asked for whole: within the
processor's message limit and half Envoy's default buffer limit (1 MiB), past which Envoy
would fail the response. A longer one is read as it passes (its tail kept)."""
DECODED_MAX = 64 << 20
"""Bytes of a compressed answer decompressed at most: twice the longest stream a 128k-token
reply makes (events cost up to about 250 bytes a token), a JSON answer's many times over."""
PIECE_SLACK = 1 << 20
PIECE_RATIO = 128
"""One piece of a compressed body may give at most `PIECE_SLACK + PIECE_RATIO * len(piece)`
bytes: text compresses 5 to 50 times, and a piece that inflates more is a bomb (16 KiB of
gzip can hold 16 MiB). Bounds the work one piece causes while other requests wait on the
event loop (16 MiB of inflating takes tens of milliseconds)."""
_SLICE = 256 << 10
"""Bytes decompressed per step: what one piece inflates to is never held whole."""


class Unread(enum.StrEnum):
    """Why an answer's usage was not read (the `reason` of `switchyard.usage.unread`)."""

    ENCODING = "encoding"  # a content-encoding zlib cannot undo
    TOO_LARGE = "too_large"  # past DECODED_MAX, or one piece past its own bound
    CORRUPT = "corrupt"  # compressed data that does not decompress


class Reader(Protocol):
    @property
    def held(self) -> int: ...

    def feed(self, piece: bytes) -> None: ...

    def end(self) -> Tokens | None: ...


class Plan(NamedTuple):
    reader: Reader
    whole: bool
    """True: ask for the body whole (BUFFERED); False: piece by piece as it passes (STREAMED)."""


_ZLIB = {b"gzip": 31, b"x-gzip": 31, b"deflate": 15}
"""zlib's `wbits` per content-encoding: 31 a gzip member, 15 the zlib format HTTP calls
deflate (a raw deflate stream, which some servers send instead, is told apart at its start)."""
_IDENTITY = (b"", b"identity")


def plan(
    ctx: RequestContext, wire: Wire | None, status: int, h: Mapping[str, bytes]
) -> Plan | None:
    """How to read a successful answer's usage from its body, given its headers; None: there
    is none to read (an error, neither JSON nor an event stream) or it cannot be read (then
    counted as unread)."""
    if not 200 <= status < 300:
        return None
    kind = h.get("content-type", b"").lower()
    stream = kind.startswith(b"text/event-stream")
    if not stream and b"json" not in kind:
        return None
    reader: Reader = StreamUsage(wire) if stream else AnswerUsage(wire)
    encoding = h.get("content-encoding", b"").strip().lower()
    if encoding not in _IDENTITY:
        wbits = _ZLIB.get(encoding)
        if wbits is None:
            count_unread(ctx, Unread.ENCODING)
            return None
        reader = Decompressing(reader, wbits, ctx)
    if stream:
        return Plan(reader, whole=False)
    declared = h.get("content-length", b"").strip()
    whole = declared.isdigit() and int(declared) <= WHOLE_ANSWER_MAX
    return Plan(reader, whole=whole)


def count_unread(ctx: RequestContext, reason: Unread) -> None:
    client = ctx.account
    tm.usage_unread.add(
        1,
        {
            tm.RESPONSE_MODEL: ctx.resolved_model or "",
            tm.ACCOUNT: "" if client is None else client.name,
            "reason": reason.value,
        },
    )


class Decompressing:
    """A usage reader behind a gzip or deflate decoder: at most `DECODED_MAX` bytes come out
    in all and `PIECE_SLACK + PIECE_RATIO * len(piece)` from one piece, `_SLICE` at a time;
    past that, or on a decoding error, nothing more is read and the answer counts as unread
    when it ends."""

    __slots__ = ("_budget", "_ctx", "_inner", "_left", "_start", "_wbits", "_z", "unread")

    def __init__(self, inner: Reader, wbits: int, ctx: RequestContext) -> None:
        self._inner, self._wbits, self._ctx = inner, wbits, ctx
        self._z: zlib._Decompress | None = None
        self._start = b""
        """The first byte of a deflate body, until the second tells its format."""
        self._left = DECODED_MAX
        self._budget = 0
        """What the piece being read may still give."""
        self.unread: Unread | None = None

    @property
    def held(self) -> int:
        return self._inner.held + len(self._start)

    def feed(self, piece: bytes) -> None:
        if self.unread is not None or not piece:
            return
        self._budget = min(self._left, PIECE_SLACK + PIECE_RATIO * len(piece))
        try:
            self._feed(piece)
        except zlib.error:
            self._stop(Unread.CORRUPT)

    def _feed(self, data: bytes) -> None:
        z = self._z
        if z is None:
            data = self._start + data
            if self._wbits == 15 and len(data) < 2:
                self._start = data  # a zlib header is two bytes
                return
            self._start = b""
            raw = self._wbits == 15 and not _zlib_header(data)
            z = self._z = zlib.decompressobj(-15 if raw else self._wbits)
        while data:
            if not self._take(z.decompress(data, min(_SLICE, self._budget + 1))):
                return
            if z.eof:
                data = z.unused_data  # gzip allows several members, one after another
                if data:
                    z = self._z = zlib.decompressobj(self._wbits)
            else:
                data = z.unconsumed_tail

    def _take(self, out: bytes) -> bool:
        """Hand `out` on if it is within the bound; False: reading stopped."""
        if len(out) > self._budget:
            self._stop(Unread.TOO_LARGE)
            return False
        self._budget -= len(out)
        self._left -= len(out)
        self._inner.feed(out)
        return True

    def _stop(self, reason: Unread) -> None:
        self.unread = reason
        self._z = None
        self._inner.end()  # lets go of what it held; its usage would be partial: not reported

    def end(self) -> Tokens | None:
        if self._z is not None and self.unread is None:
            self._budget = min(self._left, PIECE_SLACK)
            try:  # what zlib held back (a few hundred bytes at most: input is all consumed)
                self._take(self._z.flush())
            except zlib.error:
                self._stop(Unread.CORRUPT)
        if self.unread is not None:
            count_unread(self._ctx, self.unread)
            return None
        return self._inner.end()


def _zlib_header(data: bytes) -> bool:
    """Whether a deflate body opens with a zlib header (else it is raw deflate)."""
    cmf, flg = data[0], data[1]
    return cmf & 0x0F == 8 and (cmf << 8 | flg) % 31 == 0
