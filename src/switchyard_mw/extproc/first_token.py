"""The upstream-level first-token filter's streams: a stream's headers held to its first content.

A stream starts at its first content event, not at its headers (`first_token_secs`, default the
account's `timeout_secs`). Envoy runs this filter on an attempt's answer when it is a 2xx event
stream (a matcher in the example envoy.yaml), with the response body `FULL_DUPLEX_STREAMED`:
Envoy then sends the body's pieces while the processor's answer to the headers is pending. So
the answer to the headers is held, the pieces read meanwhile by the same reader as the ASGI
front's (`engine.content_events`), and

- at the first content event: the headers are answered, then each held piece in order (an
  answer to a piece before the headers' answer is a "spurious response": Envoy answers 500);
- when the stream carried the cloud's own error before any content went on (Bedrock's
  `exception` message, reported by the cloud filter: `extproc.cloud`), the machine hears
  the start and the end the forwarding app's attempt driver tells it: it fails over (the
  headers answered `x-switchyard-retry: 1`) where another account can take the request now,
  as through the forwarding app; else the stream goes on with its error event. A try of a
  hedged request that carried it while the other try races loses the race with that error's
  status, charged to its own account, and the other goes on (`hedge_tries.failed_in_stream`,
  as the ASGI front's race gives a run that ended without content);
- when the bound (`AttemptMachine.first_content_due`) passes first, with no message
  arriving: the attempt is a deadline fault of phase `first_token`
  (`AttemptMachine.content_late`), and the headers are answered `x-switchyard-retry: 1`,
  which the route retries on the next account; with no account left there, with the
  machine's answer, the wire's 504 `deadline_exceeded` (an immediate response).

Answers are not one per message here: the stream answers when content or its timer says, so a
transport hands it `emit` (`attach`) and takes None from `on` for "nothing to send now".

Past `MAX_HELD_BYTES` of opening events without content the hold lets go, as the ASGI front's
`MAX_OPENING_BYTES` does: what is held then is not worth more memory than a stream's start.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable

from .._protos.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from ..engine.content_events import ContentWatch, watch_for
from ..engine.machine import FORWARD, NEXT, Action, How, Refuse, State
from . import _messages as msg
from . import hedge_tries
from .flights import Flight, Flights, Opening, join
from .router import RETRY_HEADER
from .upstream import REQUEST_ID_ATTRIBUTE, answer_after

FIRST_TOKEN_FILTER = "first_token"
"""The `x-switchyard-filter` metadata value of the first-token filter."""
MAX_HELD_BYTES = 256 << 10
"""Opening events held without content before the hold lets go (the ASGI front's bound)."""

Emit = Callable[[ep.ProcessingResponse], None]

_RETRY = msg.response_headers(msg.mutation([(RETRY_HEADER, b"1")]))
_PASS = msg.UNCHANGED_RESPONSE_HEADERS
"""The headers let through. No `mode_override` to `NONE` for the rest of the body: measured on
Envoy 1.40, a `FULL_DUPLEX_STREAMED` body keeps coming after one, so every piece is answered."""
_TRAILERS = ep.ProcessingResponse(response_trailers=ep.TrailersResponse())
_STATUS = frozenset([":status"])


class Hold(enum.Enum):
    """Where the stream is with its answer's headers."""

    WAITING = "waiting"
    """No headers yet."""
    HOLDING = "holding"
    """Headers held; body pieces held with them until content or the bound."""
    PASSED = "passed"
    """Headers answered (released, or never held): pieces go on as they come."""
    ENDED = "ended"
    """The ext_proc stream ended: nothing more is sent."""


def _piece(body: ep.HttpBody) -> ep.ProcessingResponse:
    """The answer to a `FULL_DUPLEX_STREAMED` piece: the piece itself, unchanged (a piece
    answered with no body would reach the client empty)."""
    answer = ep.ProcessingResponse()
    streamed = answer.response_body.response.body_mutation.streamed_response
    streamed.body = body.body
    streamed.end_of_stream = body.end_of_stream
    return answer


class FirstTokenStream:
    """One first-token filter stream (one attempt's answer)."""

    def __init__(self, flights: Flights) -> None:
        self.flights = flights
        self.flight: Flight | None = None
        self.hold = Hold.WAITING
        self.emit: Emit | None = None
        self.held: list[ep.ProcessingResponse] = []
        self.held_bytes = 0
        self.watch: ContentWatch | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.attempt: int | None = None
        """Envoy's number of the try this stream holds, from its request headers (the hedged
        variant of the filter sends them: `hedge_tries`)."""
        self.which = hedge_tries.Try.FIRST
        """Which try of a hedged request this stream holds."""
        self.status = 0
        """The status of the answer whose headers are held."""

    def attach(self, emit: Emit) -> None:
        """How the transport sends an answer that is not the reply to the message in hand."""
        self.emit = emit

    def answer(self, request: ep.ProcessingRequest) -> ep.ProcessingResponse | None:
        """The answer to `request`, always at once (None: held, sent later through `emit`)."""
        kind = request.WhichOneof("request")
        if kind == "response_body":
            return self.on_body(request.response_body)
        if kind == "response_headers" and self.hold is Hold.WAITING:
            return self.on_headers(request)
        if kind == "response_trailers":
            return _TRAILERS
        if kind == "request_headers":
            self.attempt = hedge_tries.attempt_of(request)
        return msg.empty_for(request)

    def on_headers(self, request: ep.ProcessingRequest) -> ep.ProcessingResponse | None:
        flight = self.flights.find(msg.attribute(request, REQUEST_ID_ATTRIBUTE))
        machine = None if flight is None else flight.machine
        hedge = None if flight is None else flight.hedge
        self.which = hedge_tries.which(hedge, self.attempt)
        due = None if machine is None else hedge_tries.content_due(hedge, machine, self.which)
        view = None if flight is None else flight.ctx.view
        watch = None if view is None else watch_for(view.wire)
        if flight is None or due is None or watch is None or self.emit is None:
            self.hold = Hold.PASSED
            return _PASS
        self.flight, self.watch, self.hold = flight, watch, Hold.HOLDING
        self.status = int(msg.headers_of(request.response_headers, _STATUS).get(":status", b"0"))
        join(flight)
        flight.opening = Opening.HELD
        loop = asyncio.get_running_loop()
        self.timer = loop.call_later(max(due - time.monotonic(), 0.0), self.expire)
        return None

    def on_body(self, body: ep.HttpBody) -> ep.ProcessingResponse | None:
        answer = _piece(body)
        if self.hold is not Hold.HOLDING:
            return answer
        if self._lost():
            return None  # a losing try's pieces are not kept: Envoy resets it for the other
        self.held.append(answer)
        self.held_bytes += len(body.body)
        watch = self.watch
        assert watch is not None
        if watch.feed(body.body):
            self.release(content=True)
        elif body.end_of_stream or self.held_bytes > MAX_HELD_BYTES:
            self.release(content=False)
        return None

    def release(self, *, content: bool) -> None:
        """The headers answered, then the held pieces: the stream goes to the client."""
        flight = self.flight
        if self._lost():
            return  # held until Envoy resets it: the other try is the request's attempt
        if flight is not None and not content and self._lost_in_race(flight):
            return  # its own error lost it the race: held until Envoy resets it, as above
        if flight is not None and flight.ctx.upstream_status is not None:
            failed = self._failed(flight)
            if failed is not None:
                self._answer(failed)
                return
        if content and flight is not None and flight.hedge is not None and flight.machine:
            hedge_tries.won(flight.hedge, flight.machine, self.which)  # the first to content
        if flight is not None:
            flight.opening = Opening.CONTENT if content else Opening.NOT_HELD
            if content:
                flight.ctx.first_token_at = time.monotonic()
        self._answer(_PASS)

    def _lost_in_race(self, flight: Flight) -> bool:
        """Whether this try of a hedged request carried the cloud's own error before any
        content while the other raced (the cloud filter kept its status for it): it lost,
        with what that error says of its account (`hedge_tries.failed_in_stream`)."""
        hedge, machine = flight.hedge, flight.machine
        if hedge is None or machine is None:
            return False
        return hedge_tries.failed_in_stream(hedge, machine, self.which)

    def _failed(self, flight: Flight) -> ep.ProcessingResponse | None:
        """The answer to the held headers of a stream that carried the cloud's own error
        before they went on (the cloud filter reported its status): the machine hears the
        start (which holds the answer where another account can take it) and, when it held
        it, the end, and Envoy is told what follows (`answer_after`: a retry). None: the
        stream goes on, its attempt settled at its end by the router-level stream."""
        machine = flight.machine
        if machine is None or machine.state is not State.SENT or hedge_tries.racing(flight.hedge):
            return None  # not this request's attempt to judge here (a hedge races for it)
        if machine.started(self.status) is FORWARD:
            return None
        flight.opening = Opening.NOT_HELD
        return answer_after(flight, machine.ended(How.RETURNED), body=False)

    def expire(self) -> None:
        """The bound passed with no content: another account, else the 504."""
        self.timer = None
        flight = self.flight
        machine = None if flight is None else flight.machine
        if self.hold is not Hold.HOLDING or machine is None or machine.state is not State.SENT:
            self._answer(_PASS)  # the attempt is no longer this request's to judge
            return
        assert flight is not None
        hedge = flight.hedge
        if hedge is not None and (
            self._lost() or hedge_tries.lost(hedge, machine, self.which, 504)
        ):
            # A try of a hedged request that lost (now, on time, while the other races): its
            # headers stay held until Envoy resets it, when the other's reach it.
            return
        flight.opening = Opening.NOT_HELD
        end: Action = machine.content_late()
        flight.aim()  # the retry's cluster, which may be another provider's
        if end is NEXT:
            if machine.fails_over():
                self._answer(_RETRY)
                return
            # Envoy retries now or never: with no account free there, the machine answers.
            machine.retries_over()
            end = machine.next()
        view = flight.ctx.view
        if not isinstance(end, Refuse) or view is None:
            self._answer(_PASS)  # nothing of switchyard's to answer (never so: no answer held)
            return
        flight.opening = Opening.EXPIRED
        error = end.error
        self._answer(msg.immediate(view.wire, error.status, error.error_type, error.message))

    def _answer(self, first: ep.ProcessingResponse) -> None:
        emit = self.emit
        held, self.held = self.held, []
        if self.hold is Hold.ENDED or emit is None:
            return
        self.hold = Hold.PASSED
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        emit(first)
        if first.HasField("immediate_response"):
            return
        for answer in held:
            emit(answer)

    def _lost(self) -> bool:
        """Whether this stream's try lost its request's race (or is its void try)."""
        flight = self.flight
        hedge = None if flight is None else flight.hedge
        return hedge is not None and hedge_tries.lost_already(hedge, self.which)

    def close(self) -> None:
        """The ext_proc stream ended (Envoy reset it, or the answer ended)."""
        self.hold = Hold.ENDED
        self.held = []
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
