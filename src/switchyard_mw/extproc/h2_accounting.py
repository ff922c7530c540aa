"""What peers of the `h2` transport cost the process, counted without sockets or HTTP/2.

Two accounts, each at more than one level:

- **Bytes held** (`Buffers`): received and not yet handed to a handler, plus answers not yet
  written, per stream, per connection and per process, each with its bound.
- **Streams cut short** (`ResetBudget`): streams a peer resets before their answers (or opens
  over the stream limit), a token bucket per connection and one for the whole process, so
  that a peer that reconnects after each GOAWAY gets no fresh burst; `StreamsCut` spends
  from both and says what the connection must do (`Cut`).

Times are the event loop's clock, passed in: nothing here reads a clock or logs (the lines to
log are returned).
"""

from __future__ import annotations

import enum
from typing import Protocol


class Holder(Protocol):
    """A stream, as the byte account sees it."""

    held: int


class ProcessBytes:
    """Bytes held by every stream of every connection of the process."""

    __slots__ = ("held", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0


class Buffers:
    """One connection's byte account: its streams', its own and (shared) the process's.

    `add` counts bytes a stream takes on and says which bound that crosses; `release` gives
    them back (no bound to check). A stream over a bound is failed by the connection, which
    then `forget`s what it held.
    """

    __slots__ = ("connection_limit", "held", "process", "stream_limit")

    def __init__(self, stream_limit: int, connection_limit: int, process: ProcessBytes) -> None:
        self.stream_limit = stream_limit
        self.connection_limit = connection_limit
        self.process = process
        self.held = 0
        """Bytes held by all the connection's streams."""

    def add(self, stream: Holder, size: int) -> str | None:
        """Count `size` more bytes held for `stream`; the bound crossed, as a status detail,
        or None within every bound."""
        stream.held += size
        self.held += size
        process = self.process
        process.held += size
        if stream.held > self.stream_limit:
            return f"stream buffers over {self.stream_limit} bytes"
        if self.held > self.connection_limit:
            return f"connection buffers over {self.connection_limit} bytes"
        if process.held > process.limit:
            return f"process buffers over {process.limit} bytes"
        return None

    def room(self, stream: Holder) -> int:
        """Bytes `stream` may take on before `add` says a bound is crossed."""
        process = self.process
        return min(
            self.stream_limit - stream.held,
            self.connection_limit - self.held,
            process.limit - process.held,
        )

    def release(self, stream: Holder, size: int) -> None:
        """`size` bytes of `stream`'s are no longer held."""
        stream.held -= size
        self.held -= size
        self.process.held -= size

    def forget(self, stream: Holder) -> None:
        """Everything `stream` held is let go."""
        self.release(stream, stream.held)


class ResetBudget:
    """A token bucket of streams cut short: `rate` a second earned back, `burst` at most."""

    __slots__ = ("at", "burst", "rate", "tokens")

    def __init__(self, rate: float, burst: int, now: float) -> None:
        self.rate = rate
        self.burst = float(burst)
        self.tokens = float(burst)
        self.at = now

    def spend(self, now: float) -> bool:
        """Spend one; False once the budget is spent (it stays at most one token in debt, so
        a peer past it does not push the recovery further out for everyone)."""
        earned = (now - self.at) * self.rate
        self.tokens = max(min(self.burst, self.tokens + earned) - 1.0, -1.0)
        self.at = now
        return self.tokens >= 0.0


class ProcessResets(ResetBudget):
    """The process-wide budget, with what to log about it: one line when it first runs out,
    then at most one every `log_every_secs`, with how many connections were asked to calm
    down since the last line."""

    __slots__ = ("log_every_secs", "logged_at", "trips")

    def __init__(self, rate: float, burst: int, now: float, *, log_every_secs: float) -> None:
        super().__init__(rate, burst, now)
        self.log_every_secs = log_every_secs
        self.logged_at: float | None = None
        self.trips = 0
        """Connections asked to calm down since the last log line."""

    def tripped(self, now: float) -> int | None:
        """Count one connection asked to calm down; how many to log now, or None (not yet
        time for another line)."""
        self.trips += 1
        if self.logged_at is not None and now - self.logged_at < self.log_every_secs:
            return None
        trips, self.trips, self.logged_at = self.trips, 0, now
        return trips


class Cut(enum.Enum):
    """What one more stream cut short means for its connection (`StreamsCut.count`)."""

    WITHIN = "within"
    """Within both budgets (or the connection is already asked to go): nothing more."""
    CALM_DOWN = "calm down"
    """The process's budget is spent: GOAWAY ENHANCE_YOUR_CALM, no new streams, those in
    flight may finish (the connection may be an innocent one, Envoy, resetting a stream while
    another peer spends the budget)."""
    HANG_UP = "hang up"
    """The connection's own budget is spent: GOAWAY ENHANCE_YOUR_CALM, and it closes."""


class StreamsCut:
    """One connection's streams cut short (reset before their answers, or opened over the
    stream limit), spent from its own budget and the process's; each verdict with the line to
    log, if any (the process's at most once per `log_every_secs`)."""

    __slots__ = ("own", "process")

    def __init__(self, own: ResetBudget, process: ProcessResets) -> None:
        self.own = own
        self.process = process

    def count(self, now: float, *, asked_to_go: bool) -> tuple[Cut, str | None]:
        own, process = self.own, self.process
        within_own = own.spend(now)
        within_process = process.spend(now)
        if not within_own:
            return Cut.HANG_UP, (
                f"ext_proc h2: a client reset or over-opened streams faster than {own.rate:g}/s "
                f"(burst {own.burst:.0f}); closing its connection with ENHANCE_YOUR_CALM"
            )
        if within_process or asked_to_go:
            return Cut.WITHIN, None
        trips = process.tripped(now)
        if trips is None:
            return Cut.CALM_DOWN, None
        return Cut.CALM_DOWN, (
            f"ext_proc h2: clients reset or over-opened streams faster than {process.rate:g}/s "
            f"(burst {process.burst:.0f}) across the process; {trips} connection(s) asked to "
            f"go with ENHANCE_YOUR_CALM (one line per {process.log_every_secs:g} s at most)"
        )
