"""The four timers of an `h2` transport connection, without sockets or an event loop.

The connection checks them every `tick_secs` (one timer handle, not one per stream) and
passes the time in:

- **preface**: from accept to the client's first SETTINGS;
- **write stall**: answers have waited on the peer (its window, or its reading) this long;
- **idle**: no stream open this long (since the last one ended, or since accept);
- **message**: a message's first byte to its last (a length prefix that lies, then silence).

The first three end the connection (`Expiry`); the last fails the late streams alone.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar


class Expiry(enum.Enum):
    """What a check of the connection's timers found."""

    NONE = "none"
    NO_PREFACE = "no preface"
    """Close at once: there is no HTTP/2 yet to say goodbye in."""
    STALLED = "stalled"
    """GOAWAY and close: the peer takes no answers."""
    IDLE = "idle"
    """GOAWAY and close: no stream for `idle_secs`."""


class Arriving(Protocol):
    """A stream with a message half received, as the message timer sees it."""

    partial_at: float


S = TypeVar("S", bound=Arriving)


class ConnectionTimers(Generic[S]):
    """When things last happened on one connection, and which of its limits ran out."""

    __slots__ = (
        "active_at",
        "blocked_at",
        "greeted",
        "idle_secs",
        "message_secs",
        "opened_at",
        "partial",
        "preface_secs",
        "sent_at",
        "write_stall_secs",
    )

    def __init__(
        self,
        now: float,
        *,
        preface_secs: float,
        idle_secs: float,
        message_secs: float,
        write_stall_secs: float,
    ) -> None:
        self.preface_secs = preface_secs
        self.idle_secs = idle_secs
        self.message_secs = message_secs
        self.write_stall_secs = write_stall_secs
        self.opened_at = now
        self.active_at = now
        """When a stream last opened or ended."""
        self.sent_at = now
        """When answers last went to the socket."""
        self.blocked_at: float | None = None
        """When answers started waiting on the peer (None: they are not)."""
        self.greeted = False
        """The client's first SETTINGS arrived (its preface is done)."""
        self.partial: set[S] = set()
        """Streams with a message half received: the message timer watches them."""

    def expired(self, now: float, *, streams_open: bool, waiting_on_peer: bool) -> Expiry:
        """Which connection-wide limit ran out at `now`, first that of the preface."""
        if not self.greeted and now - self.opened_at > self.preface_secs:
            return Expiry.NO_PREFACE
        if self._stalled(now, waiting_on_peer):
            return Expiry.STALLED
        if not streams_open and now - self.active_at > self.idle_secs:
            return Expiry.IDLE
        return Expiry.NONE

    def _stalled(self, now: float, waiting_on_peer: bool) -> bool:
        """Answers have waited on the peer for `write_stall_secs`, counted from when they
        started waiting or last moved, whichever is later."""
        if not waiting_on_peer:
            self.blocked_at = None
            return False
        if self.blocked_at is None:
            self.blocked_at = now
        return now - max(self.blocked_at, self.sent_at) > self.write_stall_secs

    def late(self, now: float) -> Iterator[S]:
        """Streams whose message has been arriving for over `message_secs` (a list is taken
        first: failing one changes `partial`)."""
        limit = self.message_secs
        return iter([s for s in self.partial if now - s.partial_at > limit])
