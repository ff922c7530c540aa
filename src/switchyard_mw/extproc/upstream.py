"""The upstream-level filter's streams: the attempts of a request that may change account.

Envoy runs a filter in a cluster's upstream chain once per attempt, so this is where a request
changes account without leaving Envoy. Attempt 1 goes with the account the router-level stream
chose. When its response is a fault or a 429 and another account on the same cluster can serve
now, the outcome is recorded at once and the response gets `x-switchyard-retry: 1`, which the
route's retry policy (`retry_on: retriable-headers`) turns into a retry; the retry's request
headers swap in that account's credential. Routed to an aggregate cluster, a retry goes to
the next provider's cluster (`failover`): "the same cluster" is then the one it goes to. The
decision to retry is the processor's alone, so Envoy never re-sends a request to the key that
just refused it: it is the request's attempt machine (`engine.machine`, kept by its `Flight`)
that answers the refusal and takes the next lease, as it does through the ASGI front.

The example envoy.yaml runs this filter only where it can matter, so that a request answered
well by its first account costs no upstream-level stream at all: on an attempt's response only
when its status is a fault or a 429 (a matcher on `:status`), and on an attempt's request
headers only for a retry (`x-envoy-attempt-count` above 1). The response-only stream finds its
request by the `request.id` attribute. A filter configured to see every phase of every attempt
works too: attempt 1's request headers then change nothing, and its success is recorded here
rather than by the router-level stream.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Awaitable

from .._protos.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from ..context import RequestContext
from ..core.throttle import READ_HEADERS as RETRY_TIME_HEADERS
from ..engine.answers import deadline_exceeded
from ..engine.claims import claimed
from ..engine.machine import (
    NEXT,
    AttemptMachine,
    ClaimProbe,
    Failure,
    How,
    Phase,
    Refuse,
    Send,
    State,
    Wait,
)
from . import _messages as msg
from . import hedge_tries
from .failover import HOST_METADATA_ATTRIBUTE, host_cluster, next_cluster
from .flights import Flight, Flights, Opening, join, out_of_order
from .policy import Policies
from .router import (
    CREDENTIAL_HEADERS,
    REQUEST_ID_HEADER,
    RETRY_AFTER_HEADER,
    RETRY_HEADER,
    upstream_path,
)

FILTER_METADATA = "x-switchyard-filter"
"""gRPC initial metadata naming the filter level; `upstream` for the upstream-level filter."""
HEDGED_FILTER = "upstream-hedged"
"""The metadata value of the refusal filter's variant for hedged requests, which sees each
try's request headers (`hedge_tries`)."""
ATTEMPT_HEADER = "x-envoy-attempt-count"
"""Set by Envoy on each attempt when the virtual host has `include_request_attempt_count`."""
REQUEST_ID_ATTRIBUTE = "request.id"
_READ = frozenset([REQUEST_ID_HEADER, ATTEMPT_HEADER])
_STATUS = frozenset([":status", *RETRY_TIME_HEADERS])
_RETRY = msg.response_headers(msg.mutation([(RETRY_HEADER, b"1")]))
_RETRY_AFTER_BODY = ep.ProcessingResponse(
    response_body=ep.BodyResponse(
        response=ep.CommonResponse(header_mutation=msg.mutation([(RETRY_HEADER, b"1")]))
    )
)
"""The retry header set from the body phase: in BUFFERED mode Envoy still holds the headers."""
_READ_BODY = ep.ProcessingResponse(
    response_headers=ep.HeadersResponse(), mode_override=msg.READ_BUFFERED
)


ENVOY_JITTER = 1.5
"""Envoy's rate-limited back-off waits between the reset time and half again as long
(measured with Envoy 1.40: 2.1-3.1 s for 2 s, 1.3-1.5 s for 1 s)."""


def _retry_after(machine: AttemptMachine, secs: float, *, body: bool) -> ep.ProcessingResponse:
    """Ask Envoy for a retry in place after `secs`, in the whole seconds it reads, when the
    machine says even its longest jittered wait ends inside the caller's budget; else let the
    answer through. `body`: answered from the body phase (the headers held while it was read)."""
    whole = max(1, math.ceil(secs))
    if not machine.ends_in_budget(whole * ENVOY_JITTER):
        return msg.UNCHANGED_RESPONSE_BODY if body else msg.UNCHANGED_RESPONSE_HEADERS
    retry = [(RETRY_HEADER, b"1"), (RETRY_AFTER_HEADER, str(whole).encode())]
    if body:
        change = ep.CommonResponse(header_mutation=msg.mutation(retry))
        return ep.ProcessingResponse(response_body=ep.BodyResponse(response=change))
    return msg.response_headers(msg.mutation(retry))


def answer_after(flight: Flight, end: object, *, body: bool) -> ep.ProcessingResponse:
    """What Envoy is told once the machine saw the attempt's end (`end`): a retry when its
    next move can go now (another account, or the chain's model), a retry after Envoy's
    back-off when it is a retry in place, else nothing (Envoy would only re-send the request
    to the key that just refused it). `body`: answered from the body phase."""
    machine = flight.machine
    if end is NEXT and machine is not None:
        if machine.fails_over():
            return _RETRY_AFTER_BODY if body else _RETRY
        wait = machine.waits_in_place()
        if wait is not None:
            return _retry_after(machine, wait, body=body)
    return msg.UNCHANGED_RESPONSE_BODY if body else msg.UNCHANGED_RESPONSE_HEADERS


def _refused(flight: Flight, refuse: Refuse) -> ep.ProcessingResponse:
    """The machine's refusal, in the wire's shape (an immediate response)."""
    view, error = flight.ctx.view, refuse.error
    if view is None:  # a flight is made from a request read: never so
        return msg.UNCHANGED_REQUEST_HEADERS
    return msg.immediate(view.wire, error.status, error.error_type, error.message)


def _no_account_there(flight: Flight, action: object) -> ep.ProcessingResponse:
    """A retry Envoy sent to another provider's cluster, where no account can take it now
    (one was free when the retry was asked for): the previous account's key is never sent to
    another provider. The machine's refusal, in the wire's shape, when it made one; else the
    attempt goes without a credential."""
    if isinstance(action, Refuse):
        return _refused(flight, action)
    answer = ep.ProcessingResponse()
    msg.fill(answer.request_headers.response, [], CREDENTIAL_HEADERS)
    return answer


class UpstreamStream:
    """The state of one upstream-level ext_proc stream (one attempt)."""

    def __init__(self, policies: Policies, flights: Flights, *, observes: bool = False) -> None:
        self.p = policies
        self.flights = flights
        self.observes = observes
        """The hedged refusal filter's stream (`HEDGED_FILTER`): a try's request headers only
        name it (`attempt`), they change nothing."""
        self.attempt: int | None = None
        self.flight: Flight | None = None
        self.body: bytes | None = None
        """The retry's body in its account's model name, when the body phase must replace it."""
        self.seen: set[str] = set()
        """The phases this stream has taken part in: one attempt, each phase once."""
        self.reading = False
        """The response body was asked for, to read a 400 (`on_response_body`)."""
        self.cluster: str | None = None
        """The cluster Envoy sent the attempt to, as its endpoint's metadata names it (None:
        it names none; the flight's order then says where an aggregate sends a retry)."""

    def answer(
        self, request: ep.ProcessingRequest
    ) -> ep.ProcessingResponse | Awaitable[ep.ProcessingResponse]:
        """The answer to `request`, given at once but for a retry's or a hedge's request
        headers, which may wait (a probe's claim, the hedge's start): those are awaited
        (`h2_stream.Handler`)."""
        kind = request.WhichOneof("request")
        if kind == "request_body":
            return self.on_request_body()
        if kind == "response_body":
            return self.on_response_body(request.response_body.body)
        if kind not in ("request_headers", "response_headers"):
            return msg.empty_for(request)
        if kind in self.seen or "response_headers" in self.seen:
            # One stream is one attempt: a repeated phase would take a second account.
            out_of_order(kind)
            return msg.empty_for(request)
        self.seen.add(kind)
        if kind == "request_headers" and self.observes:
            # The hedged refusal filter: its try's number, for the answer it may see.
            self.attempt = hedge_tries.attempt_of(request)
            return msg.UNCHANGED_REQUEST_HEADERS
        if kind == "request_headers":
            self.cluster = host_cluster(msg.attribute(request, HOST_METADATA_ATTRIBUTE))
            return self.on_request_headers(msg.headers_of(request.request_headers, _READ))
        return self.on_response_headers(request)

    def on_request_headers(
        self, headers: msg.Headers
    ) -> ep.ProcessingResponse | Awaitable[ep.ProcessingResponse]:
        """The attempt's request headers: a first try's as the router-level stream set them
        (at once); a retry's or a hedge's with their account's credential (awaited)."""
        flight = self.flights.find(headers.get(REQUEST_ID_HEADER))
        if flight is None:
            return msg.UNCHANGED_REQUEST_HEADERS
        self.flight = flight
        join(flight)
        self.p = flight.policies or self.p  # the request's own, across a reload
        flight.upstream_attempts += 1
        attempt = headers.get(ATTEMPT_HEADER, b"")
        first = attempt == b"1" if attempt else flight.upstream_attempts == 1
        machine = flight.machine
        if first or machine is None:
            # The router-level stream chose this attempt's account and set its credential.
            return msg.UNCHANGED_REQUEST_HEADERS
        if hedge_tries.is_hedge_try(flight.hedge, machine):
            return self._hedge(flight, machine, int(attempt) if attempt.isdigit() else None)
        return self._retried(flight, machine)

    async def _retried(self, flight: Flight, machine: AttemptMachine) -> ep.ProcessingResponse:
        """A retry's request headers: the next account's credential, or the machine's answer
        when none is left."""
        # Envoy retries an attempt whose answer never started, on a connect failure or a reset
        # before the headers (the route's retry_on): the account's fault, as through the ASGI
        # front. Every answer that did start is seen by the response-side stream first (the
        # example strips a provider's own x-switchyard-retry before Envoy reads it).
        # Envoy's per-try timeout is never due before the first-token filter's timer (it is
        # the longest bound the request's tries may have, `Policies.deadline_headers`), but
        # when due with it may fire first, while the filter holds the attempt's headers (the
        # first token was late) or while its 504 is on the way (no account left: the 504 is
        # the answer).
        opening, flight.opening = flight.opening, Opening.NOT_HELD
        if opening is Opening.EXPIRED:
            flight.opening = opening
            return _refused(flight, machine.expired(Phase.FIRST_TOKEN))  # its 504 again
        held = opening is Opening.HELD
        phase = Phase.FIRST_TOKEN if held else None
        late = machine.past_deadline()  # Envoy's per-try timeout, not a dropped connection
        if machine.retried(Failure.CONNECT_ERROR, phase) is not NEXT:
            return msg.UNCHANGED_REQUEST_HEADERS  # the request ended
        moved = False
        if flight.order:
            # Envoy chose the retry's cluster (an aggregate's next): an account on it.
            cluster = self.cluster or next_cluster(flight.order, len(flight.sent_to))
            moved = cluster != flight.sent_to[-1]
            flight.sent_to.append(cluster)
            flight.aim(cluster)
        action = machine.next()
        if isinstance(action, Wait):
            action = machine.waited()  # a retry in place: Envoy's back-off did the waiting
        if isinstance(action, ClaimProbe):
            action = await claimed(machine, action)
        if held and isinstance(action, Refuse):
            # No account left: the machine's answer (for an answer held for late content,
            # the 504 of phase first_token), rather than the same account again (whose first
            # token would be as late).
            return _refused(flight, action)
        expired = flight.ctx.deadline_phase
        if late and isinstance(action, Refuse) and expired is not None:
            # Its per-try timeout with no account left: the 504 now, as through the ASGI
            # front, rather than the same request to the same late account again.
            return _refused(flight, Refuse(deadline_exceeded(expired)))
        if not isinstance(action, Send) and moved:
            return _no_account_there(flight, action)
        if not isinstance(action, Send):
            # Eligible when the retry was asked for, gone since (another request cooled it),
            # or the request ended meanwhile: the attempt goes with the previous credential.
            return msg.UNCHANGED_REQUEST_HEADERS
        # The retry's own bound (its account's), which Envoy's per-try timeout leaves room
        # for (`Policies.deadline_headers`): what binds it, and what the answer reports.
        machine.deadline(time.monotonic())
        return self._credentials(flight.ctx, flight.path, action)

    async def _hedge(
        self, flight: Flight, machine: AttemptMachine, attempt: int | None
    ) -> ep.ProcessingResponse:
        """Envoy's hedge of the request's try in flight (`hedge_tries`): the hedge's account,
        else a void try (no credential, no prompt: its refusal is dropped by Envoy)."""
        hedge = flight.hedge
        assert hedge is not None
        if flight.order:
            # Through an aggregate Envoy sends the hedge to the next provider's cluster.
            cluster = self.cluster or next_cluster(flight.order, len(flight.sent_to))
            flight.sent_to.append(cluster)
            flight.aim(cluster)
        action = await hedge_tries.start(hedge, machine, attempt)
        machine.retries_over()  # the hedge route's one retry is this try
        if action is None:
            self.body = hedge_tries.VOID_BODY
            answer = ep.ProcessingResponse()
            length = msg.option("content-length", str(len(self.body)).encode())
            msg.fill(answer.request_headers.response, [length], CREDENTIAL_HEADERS)
            return answer
        # The hedge's own context: the request's goes on naming the first try's account.
        own = copy.copy(flight.ctx)
        own.account = hedge_tries.account_of(hedge, machine, hedge_tries.Try.HEDGE)
        answer = self._credentials(own, flight.path, action)
        return answer

    def _credentials(self, ctx: RequestContext, path: bytes, action: Send) -> ep.ProcessingResponse:
        """The attempt's request headers for `action`'s account (`ctx.account`): its
        credential and, where it knows the model by another name or at another path, its body
        and `:path`."""
        sets = [*self.p.auth_options[action.lease.account]]
        client = ctx.account
        if self.p.renaming and client is not None:
            # Envoy replays the body the router-level stream sent, in the first account's
            # name: this account may know the model by another name, or at another path.
            self.body = ctx.body_for_app()
            sets.append(msg.option("content-length", str(len(self.body)).encode()))
            sets.append(msg.option(":path", upstream_path(client, path)))
        answer = ep.ProcessingResponse()
        common = answer.request_headers.response
        msg.fill(common, sets, CREDENTIAL_HEADERS)
        return answer

    def on_request_body(self) -> ep.ProcessingResponse:
        """The retry's buffered body (asked for by the example's retry filter): replaced by
        the one in this attempt's account's name, else let through."""
        body, self.body = self.body, None
        if body is hedge_tries.VOID_BODY:
            answer = msg.request_body()
            answer.request_body.response.body_mutation.clear_body = True
            return answer
        return msg.request_body(body=body)

    def on_response_headers(self, request: ep.ProcessingRequest) -> ep.ProcessingResponse:
        flight = self.flight
        if flight is None:
            flight = self.flight = self.flights.find(msg.attribute(request, REQUEST_ID_ATTRIBUTE))
            join(flight)
        machine = None if flight is None else flight.machine
        if flight is None or machine is None or machine.lease is None:
            return msg.UNCHANGED_RESPONSE_HEADERS
        self.p = flight.policies or self.p  # the request's own, across a reload
        headers = msg.headers_of(request.response_headers, _STATUS)
        status = int(headers.get(":status", b"0") or 0)
        which = hedge_tries.which(flight.hedge, self.attempt)
        if flight.hedge is not None and 200 <= status < 300:
            # A hedged request's successful JSON answer (the example's matcher sends no 2xx
            # event stream here: the first-token filter settles those): the first wins.
            if hedge_tries.answered(flight.hedge, machine, which):
                return hedge_tries.HOLD
            return msg.UNCHANGED_RESPONSE_HEADERS
        if flight.hedge is not None and hedge_tries.refused(flight.hedge, machine, which, status):
            # A try of a hedged request refused while the other races (it lost), or a void
            # try: held until Envoy resets it, when the other's headers reach it.
            return hedge_tries.HOLD
        flight.aim()  # a retry goes to the next cluster of the request's: its accounts only
        machine.started(int(headers.get(":status", b"0") or 0), headers.items())
        if machine.state is State.READING:
            # A 400 or a 429: a billing refusal, a context-length refusal or neither is in its
            # body. Buffered, Envoy holds the headers until it is read, so the retry header can
            # still go on them (`on_response_body`).
            self.reading = True
            return _READ_BODY
        # The outcome is recorded at once; a retry on the routed cluster is asked for when the
        # machine would fail over.
        return answer_after(flight, machine.ended(How.RETURNED), body=False)

    def on_response_body(self, body: bytes) -> ep.ProcessingResponse:
        """The body of a 400 or 429 asked for at its headers (the machine reads at most
        `error_bodies.MAX_BODY` of it): retried as the machine's next move says (the retry
        header set on the held headers), else it goes on."""
        flight = self.flight
        machine = None if flight is None else flight.machine
        if not self.reading or flight is None or machine is None:
            return msg.UNCHANGED_RESPONSE_BODY
        if machine.state is not State.READING:
            return msg.UNCHANGED_RESPONSE_BODY
        self.reading = False
        machine.read(body)
        return answer_after(flight, machine.ended(How.RETURNED), body=True)
