"""Requests in flight through Envoy, shared by the router-level and upstream-level filters.

Envoy opens one ext_proc stream for the router-level filter (the whole request) and one per
upstream attempt for the filter in the cluster's upstream chain. The router-level stream
registers a `Flight` and hands Envoy an unguessable ticket in `x-switchyard-ticket`; the first
attempt's stream finds the flight by it, removes the header and binds the flight to the
request's `x-request-id`, which every later attempt of the request carries (Envoy keeps an
upstream filter's request mutations for the retries, so the ticket is gone by then).

In-process state: both filters must reach the same processor process (one processor per
Envoy, or one gRPC connection). A stream that finds no flight simply does nothing extra.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from opentelemetry import trace

from ..context import RequestContext
from ..core.pool import Lease

TICKET_HEADER = "x-switchyard-ticket"
MAX_FLIGHTS = 100_000
"""A bound on state kept for Envoy: a flight lives as long as its router-level stream."""


@dataclass(eq=False, slots=True, kw_only=True)
class Flight:
    """One request's decisions and its upstream attempts."""

    ctx: RequestContext
    span: trace.Span
    ticket: str = field(default_factory=lambda: secrets.token_urlsafe(18))
    cluster: str | None = None
    lease: Lease | None = None
    """The attempt in flight, until its outcome is recorded."""
    attempt_span: trace.Span | None = None
    tried: list[str] = field(default_factory=list)
    upstream_attempts: int = 0
    """Attempts an upstream-level filter has seen (0: none configured, or not reached yet)."""
    request_id: str | None = None
    budget_bound: bool = False
    """The incoming budget, not the attempt deadline, set Envoy's timeout."""


class Flights:
    """Flights by ticket and by bound request id. Not thread-safe: one event loop."""

    def __init__(self, max_flights: int = MAX_FLIGHTS) -> None:
        self._by_ticket: dict[str, Flight] = {}
        self._by_request_id: dict[str, Flight] = {}
        self._max = max_flights

    def __len__(self) -> int:
        return len(self._by_ticket)

    def open(self, flight: Flight) -> bool:
        """Register `flight`; False when full (the request then gets no in-request failover)."""
        if len(self._by_ticket) >= self._max:
            return False
        self._by_ticket[flight.ticket] = flight
        return True

    def claim(self, ticket: bytes | None, request_id: bytes | None) -> tuple[Flight | None, bool]:
        """The flight an upstream attempt belongs to, and whether its ticket may be removed.

        The ticket is removed only once the flight is bound to the request id that the later
        attempts will carry; two live requests sharing an id keep their tickets instead.
        """
        rid = request_id.decode("latin-1") if request_id else None
        if ticket is not None:
            flight = self._by_ticket.get(ticket.decode("latin-1"))
            if flight is None:
                return None, False
            if rid is None:
                return flight, False
            bound = self._by_request_id.get(rid)
            if bound is None:
                self._by_request_id[rid] = flight
                flight.request_id = rid
                return flight, True
            return flight, bound is flight
        if rid is None:
            return None, False
        return self._by_request_id.get(rid), False

    def close(self, flight: Flight) -> None:
        self._by_ticket.pop(flight.ticket, None)
        if flight.request_id is not None and self._by_request_id.get(flight.request_id) is flight:
            del self._by_request_id[flight.request_id]
