"""The upstream-level filter's stream: one upstream attempt of a request, retries included.

Envoy runs a filter in a cluster's upstream chain once per attempt, so this is where a request
changes account without leaving Envoy. Attempt 1 goes with the account the router-level stream
chose. Its response status is recorded at once; when it is a fault or a 429 and another account
on the same cluster can serve now, the response gets `x-switchyard-retry: 1`, which the route's
retry policy (`retry_on: retriable-headers`) turns into a retry, and the retry's stream here
swaps in that account's credential. The decision to retry is the processor's alone, so Envoy
never re-sends a request to the key that just refused it.
"""

from __future__ import annotations

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from .. import telemetry as tm
from ..cooling_outcomes import outcome_of
from ..core.pool import Outcome
from . import _messages as msg
from .flights import TICKET_HEADER, Flight, Flights
from .policy import Policies
from .router import CREDENTIAL_HEADERS, RETRY_HEADER

FILTER_METADATA = "x-switchyard-filter"
"""gRPC initial metadata naming the filter level; `upstream` for the upstream-level filter."""


class UpstreamStream:
    """The state of one upstream-level ext_proc stream (one attempt)."""

    def __init__(self, policies: Policies, flights: Flights) -> None:
        self.p = policies
        self.flights = flights
        self.flight: Flight | None = None

    async def on(self, request: ep.ProcessingRequest) -> ep.ProcessingResponse:
        kind = request.WhichOneof("request")
        if kind == "request_headers":
            return await self.on_request_headers(msg.headers_of(request.request_headers))
        if kind == "response_headers":
            return self.on_response_headers(msg.headers_of(request.response_headers))
        return msg.empty_for(request)

    async def on_request_headers(self, headers: msg.Headers) -> ep.ProcessingResponse:
        flight, unticket = self.flights.claim(
            headers.get(TICKET_HEADER), headers.get("x-request-id")
        )
        if flight is None:
            return msg.request_headers()
        self.flight = flight
        remove = [TICKET_HEADER] if unticket else []
        flight.upstream_attempts += 1
        if flight.upstream_attempts == 1 and flight.lease is not None:
            # The router-level stream chose this attempt's account and set its credential.
            return msg.request_headers(msg.mutation(remove=remove) if remove else None)
        if flight.lease is not None:  # the previous attempt ended without a response
            self.p.settle(flight, Outcome.FAULT, "no_response")
        lease = await self.p.next_on_cluster(flight)
        if lease is None:
            # Eligible when the retry was asked for, gone since (another request cooled it):
            # the attempt goes with the previous credential, the only one left.
            return msg.request_headers(msg.mutation(remove=remove) if remove else None)
        ctx = flight.ctx
        tm.failovers.add(1, {"route_model": ctx.resolved_model or ""})
        ctx.attempts += 1
        client = self.p.start_attempt(flight, lease)
        sets = [(k, v.encode()) for k, v in client.auth_headers()]
        return msg.request_headers(msg.mutation(sets, [*CREDENTIAL_HEADERS, *remove]))

    def on_response_headers(self, headers: msg.Headers) -> ep.ProcessingResponse:
        flight = self.flight
        if flight is None or flight.lease is None:
            return msg.response_headers()
        status = int(headers.get(":status", b"0") or 0)
        outcome, text = outcome_of(status)
        self.p.settle(flight, outcome, text)
        if outcome is not Outcome.SUCCESS and self.p.another_on_cluster(flight):
            return msg.response_headers(msg.mutation([(RETRY_HEADER, b"1")]))
        return msg.response_headers()
