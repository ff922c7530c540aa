"""Requests in flight through Envoy, shared by the router-level and upstream-level filters.

Envoy opens one ext_proc stream for the router-level filter (the whole request) and, when the
upstream-level filter runs, one per upstream attempt. Both carry the request's `x-request-id`
(Envoy sets it before any filter runs): the router-level stream registers a `Flight` under it,
and an upstream-level stream finds the flight by it, from the request headers of a retry or
from the `request.id` attribute on an attempt's response.

Two requests in flight under the same id (a client may send its own) are told apart by
nothing, so neither is findable while both live: they get no in-request failover, and an
upstream-level stream finds no flight and changes nothing.

In-process state: both filters must reach the same processor process (one processor per
Envoy, or one gRPC connection per Envoy worker thread, which is what Envoy opens).
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from opentelemetry import trace

from ..context import RequestContext, current_var
from ..core.clock import Clock, monotonic
from ..engine.machine import AttemptMachine
from .failover import next_cluster
from .hedge_tries import Hedge

if TYPE_CHECKING:
    from .policy import Policies

MAX_FLIGHTS = 100_000
"""A bound on state kept for Envoy: a flight lives as long as its router-level stream."""
LOG_EVERY_SECS = 60.0
"""At most one line per this many seconds about peers breaking the phase order."""
_log = logging.getLogger(__name__)


class Opening(enum.Enum):
    """The attempt's headers and the first-token filter."""

    NOT_HELD = "not_held"
    HELD = "held"
    """Held back until the first content event or the first-token bound."""
    CONTENT = "content"
    """Let go at the first content event."""
    EXPIRED = "expired"
    """No content in time and no account left: the first-token filter answered the 504 (Envoy
    may retry meanwhile, its per-try timeout being due at the same time)."""


class Judged(enum.Enum):
    """When the router-level stream settles the final attempt (its answer's outcome)."""

    AT_HEADERS = "at_headers"
    """At its response headers: its status says all its answer can say."""
    AT_END = "at_end"
    """At the end of its body, read for it: a cloud's stream the cloud filter translates may
    still carry the cloud's own error (Bedrock's `exception` message), which the cloud filter
    reports on the request's context, as the forwarding app's relay does."""


@dataclass(eq=False, slots=True, kw_only=True)
class Flight:
    """One request: its context, its attempt machine, and what ties its streams together.

    The router-level stream and every upstream-level stream of the request feed the same
    `machine`: it alone decides, acquires, records and releases the request's leases."""

    ctx: RequestContext
    span: trace.Span | None = None
    """The request's span; None when no tracer SDK is installed (nothing would record it)."""
    machine: AttemptMachine | None = None
    """The request's attempts, once its body was read."""
    cluster: str | None = None
    order: tuple[str, ...] = ()
    """The clusters its attempts go to, in Envoy's order: more than one when it was routed to
    an aggregate cluster (`failover`)."""
    sent_to: list[str] = field(default_factory=list)
    """The cluster of each attempt so far."""
    upstream_attempts: int = 0
    """Attempts whose request headers an upstream-level filter has seen."""
    request_id: str | None = None
    """The id the flight is registered under (None: not registered)."""
    closed: bool = False
    """Its router-level stream ended: no attempt may start on it any more."""
    policies: Policies | None = None
    """The policies the request started with: its upstream-level streams use them too, even
    after a reload put others in force."""
    path: bytes = b""
    """The client's `:path`: a retry to an account without a path template goes back to it."""
    opening: Opening = Opening.NOT_HELD
    """Where the first-token filter (`first_token`) is with the attempt's headers: a timeout
    Envoy fires while they are HELD is the first token's, and CONTENT is told the machine
    by the router-level stream when the headers reach it."""
    hedge: Hedge | None = None
    """Its hedge, when the route may hedge it (`hedge_tries`)."""
    judged: Judged = Judged.AT_HEADERS
    """When its final attempt is settled: set by the cloud filter for each answer it sees. A
    later attempt through a cluster without that filter (an aggregate's API provider) keeps
    the last one's: settled at its end then, with the verdict its headers would have given."""

    def aim(self, cluster: str | None = None) -> None:
        """Bind the request's next attempt to the accounts of `cluster`, the one Envoy sends
        it to (by default: the next of `order`). Envoy picks the cluster; the machine picks
        an account on it."""
        machine, policies = self.machine, self.policies
        if machine is None or policies is None or not self.order:
            return
        if cluster is None:
            cluster = next_cluster(self.order, len(self.sent_to))
        machine.within = policies.on(cluster)

    @property
    def tried(self) -> list[str]:
        """The accounts tried so far, in order."""
        return [] if self.machine is None else self.machine.tried


def join(flight: Flight | None) -> None:
    """Make `flight`'s request the current one of the calling ext_proc stream, so the decision
    records its work makes from now on carry the request's id. Each stream runs in a context
    of its own (a task per call under grpc.aio, a `Context` per stream under h2) and serves one
    request, so the context is never reset: it ends with the stream."""
    if flight is not None:
        current_var.set(flight.ctx)


class Flights:
    """Flights by request id. Not thread-safe: one event loop."""

    def __init__(self, max_flights: int = MAX_FLIGHTS) -> None:
        self._by_id: dict[str, Flight | None] = {}
        """None marks an id shared by live flights: none of them is findable."""
        self._live: dict[str, int] = {}
        self._count = 0
        self._max = max_flights

    def __len__(self) -> int:
        return self._count

    def open(self, flight: Flight, request_id: str) -> bool:
        """Register `flight` under `request_id`; whether upstream-level streams can find it
        (False when full, or when another live flight has the same id)."""
        if self._count >= self._max or flight.request_id is not None or flight.closed:
            return False
        live = self._live.get(request_id, 0)
        self._live[request_id] = live + 1
        self._by_id[request_id] = flight if live == 0 else None
        flight.request_id = request_id
        self._count += 1
        return live == 0

    def find(self, request_id: str | bytes | None) -> Flight | None:
        if not request_id:
            return None
        if isinstance(request_id, bytes):
            request_id = request_id.decode("latin-1")
        return self._by_id.get(request_id)

    def close(self, flight: Flight) -> None:
        """Unregister `flight` (once) and mark it ended."""
        flight.closed = True
        request_id, flight.request_id = flight.request_id, None
        if request_id is None:
            return
        self._count -= 1
        live = self._live[request_id] - 1
        if live:
            self._live[request_id] = live  # the id stays ambiguous while another lives
        else:
            del self._live[request_id]
            del self._by_id[request_id]


class _Episodes:
    """Counts peers' phase-order breaches, saying so in one log line per `LOG_EVERY_SECS`
    however many there are: a hostile peer sends them by the hundred thousand."""

    def __init__(self, clock: Clock = monotonic) -> None:
        self.clock = clock
        self.total = 0
        self._unsaid = 0
        self._said_at: float | None = None

    def __call__(self, phase: str) -> None:
        self.total += 1
        self._unsaid += 1
        now = self.clock()
        if self._said_at is not None and now - self._said_at < LOG_EVERY_SECS:
            return
        _log.warning(
            "ext_proc peer sent %s out of order (%d such message(s) since the last line): "
            "answered unchanged; Envoy sends each phase once, so the peer is not a "
            "well-configured Envoy",
            phase,
            self._unsaid,
        )
        self._said_at, self._unsaid = now, 0


out_of_order = _Episodes()
"""Call with the phase's name when a stream receives a phase it already took or after its end."""
