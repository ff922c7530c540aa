"""The router-level filter's stream: one request, from its headers to its response headers.

Request headers: strip what a client may not set (the routing header, Envoy's control
headers) and refuse a body over the limit. Buffered body: read it with the wire reader, run the
judge and the variants, pick the account, then tell Envoy where to send it
(`x-switchyard-cluster`, with the route cache cleared), with which credential and for how long.
Response headers: the final status is the last attempt's outcome (unless an upstream-level
filter recorded it already, as it does for refusals), an Envoy timeout becomes a 504 in the
wire's format, and the `x-switchyard-*` headers are added. A successful answer's body is asked
for (`mode_override`) when its token usage can be read: it passes piece by piece, each answered
at once and unchanged, and the request's telemetry ends with it (`engine.usage` reads it).

Only the headers read here are looked at (`_READ`); envoy.yaml's `forward_rules` can keep Envoy
from sending the others at all.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable

from opentelemetry import context as otel_context
from opentelemetry import trace

from .._protos.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from ..accounts import Account
from ..answer_names import Namer
from ..context import RequestContext, decision_attributes
from ..core.compiled import mypyc_attr
from ..core.deadline_math import BUDGET_HEADERS
from ..core.throttle import READ_HEADERS as RETRY_TIME_HEADERS
from ..engine.answers import (
    DEADLINE_EXCEEDED,
    NO_HEALTHY_ACCOUNT,
    RATE_LIMITED,
    UPSTREAM_UNREACHABLE,
    exposed_headers,
)
from ..engine.claims import claimed
from ..engine.content_events import ContentWatch, watch_for
from ..engine.machine import (
    FORWARD,
    PASS_THROUGH,
    AttemptMachine,
    ClaimProbe,
    Failure,
    Gone,
    How,
    Phase,
    Refuse,
    Send,
    Start,
    State,
)
from ..engine.provider_headers import (
    REQUEST_ID_KEYS,
    UPSTREAM_REQUEST_ID,
    WITHHELD_KEY_PREFIXES,
    WITHHELD_KEYS,
    request_id,
)
from ..engine.tenancy import PROVIDER_RATE_LIMIT_HEADERS, Admission, Refusal, Tenancy, billed
from ..engine.usage import report_tokens
from ..model_names import with_query
from ..telemetry import names as tm
from ..telemetry import request_metrics
from ..telemetry.logs import request_id_from
from ..wire import Wire, WireError, model_not_served, read_request, too_large
from . import _messages as msg
from . import body_usage, hedge_tries
from .body_usage import Reader
from .flights import Flight, Flights, Judged, Opening, join, out_of_order
from .policy import CLUSTER_HEADER, HEDGE_HEADER, Policies

CONTENT, HELD, EXPIRED = Opening.CONTENT, Opening.HELD, Opening.EXPIRED
RETRY_HEADER = "x-switchyard-retry"
RETRY_AFTER_HEADER = "x-switchyard-retry-after"
"""Set beside `RETRY_HEADER` for a retry in place: the whole seconds Envoy waits first (the
route's `rate_limited_retry_back_off` reads it, in whole seconds)."""
CREDENTIAL_HEADERS = ("authorization", "x-api-key", "api-key")
__all__ = [
    "DEADLINE_EXCEEDED",
    "NO_HEALTHY_ACCOUNT",
    "RATE_LIMITED",
    "UPSTREAM_UNREACHABLE",
    "RouterStream",
]
REQUEST_ID_HEADER = "x-request-id"
_UNTRUSTED = [CLUSTER_HEADER, HEDGE_HEADER]
"""Headers only the processor may set: a client's copies are removed before routing."""
_ENVOY_CONTROL = [
    "x-envoy-upstream-rq-timeout-ms",
    "x-envoy-upstream-rq-per-try-timeout-ms",
    "x-envoy-max-retries",
    "x-envoy-retry-on",
    "x-envoy-retriable-status-codes",
    "x-envoy-retriable-header-names",
]
"""Headers that would let a client lengthen its deadline or steer retries: the deadline and
failover are policy (an incoming budget header can only shorten, and stays)."""
VERSION_HEADER = "anthropic-version"
"""Says an answer to a path of no wire (`/v1/models`, a 404) is Anthropic's (`engine.endpoints`)."""
_READ = frozenset(
    [":method", ":path", "content-type", "content-length", REQUEST_ID_HEADER, VERSION_HEADER]
    + [name.decode() for name in BUDGET_HEADERS]
)
_BODY = "request_body"
_ANSWERED = "response_headers"
_PHASES = frozenset(["request_headers", _BODY, _ANSWERED])
"""The phases a router-level stream takes part in (Envoy sends the others only when
misconfigured; they get a no-change answer)."""
_READ_RESPONSE = frozenset(
    [
        ":status",
        "content-type",
        "content-length",
        "content-encoding",
        "x-envoy-upstream-service-time",
        *RETRY_TIME_HEADERS,
    ]
)
# The answers to request headers never vary: built once.
_PASS_THROUGH = msg.request_headers(msg.mutation(remove=_UNTRUSTED), pass_through=True)
_READ_BODY = msg.request_headers(msg.mutation(remove=[*_UNTRUSTED, *_ENVOY_CONTROL]))


def _gone() -> bool:
    """Asked by the judge when its wait is cancelled: a cancelled stream is Envoy hanging up."""
    return True


@mypyc_attr(allow_interpreted_subclasses=True)  # compiled, tests still subclass it
class RouterStream:
    """The state of one router-level ext_proc stream (one HTTP request)."""

    def __init__(
        self,
        policies: Policies,
        flights: Flights,
        parent: otel_context.Context | None,
        gone: Callable[[], bool] = _gone,
    ) -> None:
        self.p = policies
        self.flights = flights
        self.parent = parent
        """The trace context Envoy sent; None when no tracer SDK is installed (no spans)."""
        self.gone = gone
        self.wire: Wire | None = None
        self.route = ""
        """The request's path without its query."""
        self.headers: msg.Headers = {}
        self.started_at = time.monotonic()
        self.span: trace.Span | None = None
        self.flight: Flight | None = None
        self.seen: set[str] = set()
        """The phases this stream has taken part in: each is taken once, in order."""
        self.closed = False
        self.usage: Reader | None = None
        """Reads the response body's usage, while Envoy sends it (asked for at its headers)."""
        self.content: ContentWatch | None = None
        """Finds a stream's first content event in the body read (the time to first token),
        with the ASGI front's reader."""
        self.namer: Namer | None = None
        """Writes the public model name into the body read, where the account's differs."""
        self.whole = False
        """The body read comes in one message (BUFFERED): a new length is set on it."""
        self.admission: Admission | None = None
        """What the request holds of its tenant's limits (None: no `[tenants]`)."""
        self.answered = False
        """A provider's successful answer went to the client: its reservation is kept when
        its usage is not read."""
        self.judging: AttemptMachine | None = None
        """The machine whose final attempt is settled at the end of the body read
        (`Judged.AT_END`): a cloud's translated stream, which may still carry its error."""

    def answer(
        self, request: ep.ProcessingRequest
    ) -> ep.ProcessingResponse | Awaitable[ep.ProcessingResponse]:
        """The answer to `request`, given at once but for a request's body whose placing
        waits (a judge, a tenant's store, a probe's claim): that one is awaited
        (`h2_stream.Handler`)."""
        kind = request.WhichOneof("request")
        if kind == "response_body" and self.usage is not None:
            return self.on_response_body(request.response_body)
        if kind == _BODY:
            return self.answer_body(request.request_body.body)
        if not self._in_order(kind):
            return self._out_of_order(kind, msg.empty_for(request))
        self.seen.add(kind)
        if kind == "request_headers":
            answer = self.on_request_headers(request.request_headers)
            last = False
        else:
            answer = self.on_response_headers(request)
            last = self.usage is None  # no body to read the usage from
        if last or answer.HasField("immediate_response"):
            # The last phase switchyard takes part in: the request's telemetry ends here,
            # before Envoy answers the client.
            self.close()
        return answer

    def answer_body(self, body: bytes) -> ep.ProcessingResponse | Awaitable[ep.ProcessingResponse]:
        """`answer` for the request's body, handed on as its own bytes (`h2_stream.TakesBody`:
        the transport takes them out of the message without protobuf's two copies)."""
        # In order only after headers switchyard reads, and before the answer's headers (the
        # body's rule of `_in_order`, here: a call fewer on every request).
        if self.closed or _BODY in self.seen or self.wire is None or _ANSWERED in self.seen:
            return self._out_of_order(_BODY, msg.UNCHANGED_REQUEST_BODY)
        self.seen.add(_BODY)
        placed = self.on_request_body(body)
        if not isinstance(placed, ep.ProcessingResponse):
            return self._placed_later(placed)
        if placed.HasField("immediate_response"):  # the last phase: see `answer`
            self.close()
        return placed

    def _out_of_order(
        self, kind: str | None, unchanged: ep.ProcessingResponse
    ) -> ep.ProcessingResponse:
        # Envoy sends each phase once, in order; another message (a second body, headers
        # again, anything after the request's end) would start a second flight over the
        # first: it changes nothing instead.
        if kind in self.seen or (self.closed and kind in _PHASES):
            out_of_order(kind)
        return unchanged

    async def _placed_later(
        self, placing: Awaitable[ep.ProcessingResponse]
    ) -> ep.ProcessingResponse:
        answer = await placing
        if answer.HasField("immediate_response"):  # the last phase: see `answer`
            self.close()
        return answer

    def _in_order(self, kind: str | None) -> bool:
        """Whether `kind`, a phase but the body (`answer_body` has its rule), is one this
        stream still takes: request headers first, response headers once after them; none
        after the end."""
        if self.closed or kind not in _PHASES or kind in self.seen:
            return False
        return kind == "request_headers" or "request_headers" in self.seen

    def on_request_headers(self, http: ep.HttpHeaders) -> ep.ProcessingResponse:
        identity = self.p.identity_headers
        self.headers = h = msg.headers_of(http, _READ | identity if identity else _READ)
        method, path = h.get(":method", b""), h.get(":path", b"")
        self.route = path.split(b"?", 1)[0].decode("latin-1")
        self.wire = self.p.wire_of(method, path, h.get("content-type"))
        if self.wire is None:
            return self._other(method.decode("latin-1"), path)
        if self.parent is not None:
            self.span = tm.tracer.start_span(
                tm.SPAN_REQUEST, context=self.parent, kind=trace.SpanKind.SERVER
            )
        limit = self.p.server.max_body_bytes
        declared = h.get("content-length", b"").strip()
        if declared.isdigit() and int(declared) > limit:
            return self.refuse(too_large(limit))
        if http.end_of_stream:  # no body at all: what the wire reader says of an empty one
            try:
                read_request(self.wire, b"")
            except WireError as exc:
                return self.refuse(exc)
        return _READ_BODY

    def _other(self, method: str, path: bytes) -> ep.ProcessingResponse:
        """A request that is no LLM call: the models list or the wire's 404 under `/v1/`
        (answered here, as the forwarding app does), anything else passed through."""
        endpoints = self.p.endpoints
        if not endpoints.ours(method, self.route):
            return _PASS_THROUGH
        query = path.partition(b"?")[2].decode("latin-1")
        versioned = VERSION_HEADER in self.headers
        answer = endpoints.answer(method, self.route, query, anthropic_version=versioned)
        return msg.json_reply(answer.status, answer.body, f"switchyard_{answer.status}")

    def on_request_body(
        self, body: bytes
    ) -> ep.ProcessingResponse | Awaitable[ep.ProcessingResponse]:
        """Read the body, then place the request: at once, unless the placing asks a judge
        (a judged route), a tenant's store (`[tenants]`) or a shared store (a probe's claim),
        whose answers are awaited."""
        assert self.wire is not None
        limit = self.p.server.max_body_bytes
        if len(body) > limit:
            return self.refuse(too_large(limit))
        try:
            view = read_request(self.wire, body, self.route)
        except WireError as exc:
            return self.refuse(exc)
        ctx = RequestContext(view=view, body=body, now=self.started_at)
        ctx.budget_at = self.p.budget_at(self.headers, self.started_at)
        ctx.request_id = request_id_from(self.headers.get(REQUEST_ID_HEADER))
        self.flight = flight = Flight(ctx=ctx, span=self.span, policies=self.p)
        join(flight)
        flight.path = self.headers.get(":path", b"")
        tenancy = self.p.tenancy
        if tenancy is not None or self.p.judged(ctx):
            return self._decided(flight, tenancy)
        if self.span is None:
            self.p.assign_variant(ctx)
        else:
            with trace.use_span(self.span, end_on_exit=False):
                self.p.assign_variant(ctx)
        return self._begun(flight)

    async def _decided(self, flight: Flight, tenancy: Tenancy | None) -> ep.ProcessingResponse:
        """Place a request whose placing waits: its tenant checked and admitted, its route
        judged, its variant chosen."""
        ctx = flight.ctx
        # Who is asking, before anything is spent on the request (the judge included).
        if (
            tenancy is not None
            and (refusal := tenancy.check(ctx, named=None, header=self._header)) is not None
        ):
            return self.refuse(refusal.error, _text(refusal.headers))
        if self.span is None:
            await self.p.decide_model(ctx, self.gone)
        else:
            with trace.use_span(self.span, end_on_exit=False):
                await self.p.decide_model(ctx, self.gone)
        if self.closed:
            return msg.request_body()  # the stream ended meanwhile: nothing to place
        if (
            tenancy is not None
            and billed(self.route)
            and (refused := await self._admit(tenancy, ctx)) is not None
        ):
            return refused
        placed = self._begun(flight)
        return placed if isinstance(placed, ep.ProcessingResponse) else await placed

    def _begun(self, flight: Flight) -> ep.ProcessingResponse | Awaitable[ep.ProcessingResponse]:
        """The machine's first attempt placed, once the model is decided: at once, unless it
        asks for a probe's claim first."""
        machine = flight.machine = self.p.machine(flight)
        action = machine.begin()
        if isinstance(action, ClaimProbe):
            return self._claimed(flight, machine, action)
        return self._sent(flight, action)

    async def _claimed(
        self, flight: Flight, machine: AttemptMachine, action: ClaimProbe
    ) -> ep.ProcessingResponse:
        return self._sent(flight, await claimed(machine, action))

    def _sent(self, flight: Flight, action: Start) -> ep.ProcessingResponse:
        """Where Envoy sends the machine's first attempt (its account's cluster, credential
        and deadline), or the answer when it sends none."""
        ctx = flight.ctx
        if not isinstance(action, Send):
            return self._unsent(action, ctx)
        machine = flight.machine
        assert machine is not None
        lease = action.lease
        reach = self.p.reach(lease.account, action.model)
        flight.order = order = reach.order
        flight.cluster = cluster = order[0]  # the account's: the one its order starts with
        flight.sent_to.append(cluster)
        # The machine's reach: the accounts of the cluster Envoy sends the next attempt to,
        # however it starts (a retry, the hedge, a late first token's retry); through an
        # aggregate, the next provider's. The hedge and the first-token bound ask it before
        # any upstream-level stream could aim it.
        flight.aim()
        request_id = self.headers.get(REQUEST_ID_HEADER)
        if request_id:  # upstream-level streams find the flight by it
            self.flights.open(flight, request_id.decode("latin-1"))
        options = self.p.options
        sets = [*self.p.routing(lease.account, order)]
        timeouts = self.p.deadline_headers(machine, reach.secs(ctx.view))
        if self.p.server.envoy_hedge:  # off (the default): not even a call
            hedge = flight.hedge = hedge_tries.arm(machine)
            if hedge is not None:
                timeouts = self.p.hedged(timeouts, hedge.after_secs)
        sets += [options.get(k, v) for k, v in timeouts]
        client = ctx.account
        if client is not None and client.spec.path is not None:
            # the provider's path for the model (the route is read again)
            sets.append(msg.option(":path", upstream_path(client, flight.path)))
        if self.p.plain_answers:  # an answer renamed is read as it comes: not compressed
            sets.append(options.get("accept-encoding", b"identity"))
        answer = ep.ProcessingResponse()
        common = answer.request_body.response
        new_body = ctx.body_for_app()
        if new_body is not ctx.body:
            sets.append(msg.option("content-length", str(len(new_body)).encode()))
            common.body_mutation.body = new_body
        msg.fill(common, sets, CREDENTIAL_HEADERS)
        common.clear_route_cache = True
        return answer

    async def _admit(self, tenancy: Tenancy, ctx: RequestContext) -> ep.ProcessingResponse | None:
        """Reserve the request's worst case against its tenant's limits: the refusal when a
        limit is spent, or an empty answer when the stream ended while the store answered;
        None: admitted, placed next."""
        admitted = await tenancy.admit_request(ctx)
        if isinstance(admitted, Refusal):
            return self.refuse(admitted.error, _text(admitted.headers))
        self.admission = admitted
        if self.closed:  # the stream ended while the store answered
            self._finish(admitted, ctx)
            return msg.request_body()
        return None

    def _unsent(self, action: Start, ctx: RequestContext) -> ep.ProcessingResponse:
        """The machine sends no attempt: its refusal, a request only accounts Envoy cannot
        route to serve (or none), or nothing when the stream ended while a probe was claimed."""
        if isinstance(action, Refuse):
            return self.refuse(action.error, [(k.decode(), v) for k, v in action.headers])
        if action is PASS_THROUGH and ctx.resolved_model is not None:
            return self._not_placed(ctx)
        return msg.request_body()

    def _not_placed(self, ctx: RequestContext) -> ep.ProcessingResponse:
        """A request no account Envoy can route to serves."""
        assert self.wire is not None
        model = ctx.resolved_model
        assert model is not None
        if not self.p.pool.accounts_for(model):
            # No account serves it: behind Envoy there is no app that might, so the
            # processor answers as the example gateway's forwarder does.
            return self.refuse(model_not_served(self.wire, model))
        # Only accounts Envoy cannot route to serve it: on, untouched but for the model.
        return self._unrouted(ctx)

    def _unrouted(self, ctx: RequestContext) -> ep.ProcessingResponse:
        body = ctx.body_for_app()
        if body is ctx.body:
            return msg.request_body()
        length = [("content-length", str(len(body)).encode())]
        return msg.request_body(msg.mutation(length), body)

    def on_response_headers(self, request: ep.ProcessingRequest) -> ep.ProcessingResponse:
        flight = self.flight
        if flight is None:
            return msg.UNCHANGED_RESPONSE_HEADERS
        h, removed, ids = _response_headers(request.response_headers)
        status = int(h.get(":status", b"0") or 0)
        flight.ctx.response_status = status
        details = msg.attribute(request, "response.code_details")
        local = details != "via_upstream" if details else _looks_local(h)
        if local and status == 504 and (details is None or "timeout" in details):
            return self._deadline(flight)
        self.answered = not local and status < 400
        plan = None
        if not local and not request.response_headers.end_of_stream:
            # How to read a successful answer's usage from its body; None: nothing to read,
            # or it cannot be read (then counted as unread there).
            plan = body_usage.plan(flight.ctx, self.wire, status, h)
        self._attempt_ended(flight, h, status, details, local=local, body_follows=plan is not None)
        machine = flight.machine
        # The provider's request id noted (an answer Envoy made itself has none).
        flight.ctx.upstream_request_id = None if local else request_id(ids)
        instead = None if machine is None or local else machine.replacement()
        if instead is not None:
            # The last attempt refused its account's key or billing: the provider's refusal
            # of its own key is never the client's (the machine's 503 says so).
            return self.refuse(instead.error, [(k.decode(), v) for k, v in instead.headers])
        answer = ep.ProcessingResponse()
        options = self.p.options
        exposed = [
            options.get(k, v) if k != _UPSTREAM_ID else msg.option(k, v)  # unique: not kept
            for k, v in self._exposed()
        ]
        remove = [RETRY_HEADER, RETRY_AFTER_HEADER]
        limits = flight.ctx.limit_headers
        if limits is not None:  # the tenant's rate-limit headers in place of the account's
            ours = _text(limits)
            exposed += [msg.option(k, v) for k, v in ours]
            named = {k for k, _ in ours}
            remove += [n for n in PROVIDER_RATE_LIMIT_HEADERS if n not in named]
        msg.fill(answer.response_headers.response, exposed, remove)
        if removed:
            msg.fill(answer.response_headers.response, (), removed)
        if plan is not None:
            self.usage = plan.reader
            self.whole = plan.whole
            client = flight.ctx.account
            self.namer = None
            if client is not None:
                kind, encoding = h.get("content-type", b""), h.get("content-encoding", b"")
                self.namer = client.answer_namer(kind, encoding)
            if self.namer is not None and not self.whole:
                # Its pieces may change length: Envoy refuses a mutation that breaks the
                # length declared, and chunks the answer without one.
                msg.fill(answer.response_headers.response, (), ["content-length"])
            view = flight.ctx.view
            if view is not None and view.stream and flight.ctx.first_token_at is None:
                self.content = watch_for(self.wire)
            answer.mode_override.CopyFrom(msg.READ_BUFFERED if plan.whole else msg.READ_STREAMED)
            # No attempt follows the final answer: the registry holds the flight no longer.
            self.flights.close(flight)
        return answer

    def _attempt_ended(
        self,
        flight: Flight,
        h: msg.Headers,
        status: int,
        details: str | None,
        *,
        local: bool,
        body_follows: bool,
    ) -> None:
        """The machine hears how its attempt ended: in Envoy's own reply (`local`), or in the
        provider's answer, whose body is read next when `body_follows`."""
        machine = flight.machine
        if machine is None:
            return
        if machine.state is State.READING:
            # The upstream-level filter asked for a 400's body and it never came (a filter
            # without allow_mode_override): read nothing, the 400 is the answer.
            machine.ended(How.RETURNED)
        if machine.lease is None:
            return
        machine.retries_over()  # Envoy is past retrying: this answer is the answer
        if local and details and details.startswith("upstream_reset_before_response"):
            # No provider answered: the account's fault. Envoy's reply is already the
            # wire's 502 (envoy.yaml's local_reply_config); answering again would wrap it,
            # so the machine's refusal (the same 502) is not sent.
            machine.ended(How.RAISED, Failure.CONNECT_ERROR)
        elif local:
            machine.ended(How.GONE, gone=Gone.LOCAL_REPLY)  # Envoy's own answer: no account's
        else:
            # The first-token filter heard the start already when the cloud's stream carried
            # its own error before content and nothing could follow it (its `_failed`).
            if (
                machine.state is State.SENT
                and machine.started(status, h.items()) is FORWARD
                and flight.opening is CONTENT
            ):
                machine.first_content()  # held to it by the first-token filter
            if body_follows and flight.judged is Judged.AT_END:
                # The cloud's stream may carry its own error after this: the attempt ends
                # with its body, as it ends through the forwarding app (`close`).
                self.judging = machine
                return
            machine.ended(How.RETURNED, body_follows=body_follows)

    def on_response_body(self, http: ep.HttpBody) -> ep.ProcessingResponse:
        """A piece of the answer's body: read, and let go on at once (its model renamed)."""
        usage = self.usage
        assert usage is not None
        piece = http.body
        usage.feed(piece)
        flight, content = self.flight, self.content
        if flight is not None and content is not None and content.feed(piece):
            flight.ctx.first_token_at = time.monotonic()
            self.content = None  # found: the rest passes unread
        if http.end_of_stream:
            self.close(whole=True)
        namer = self.namer
        if namer is None:
            return msg.UNCHANGED_RESPONSE_BODY
        out = namer.feed(piece)
        if http.end_of_stream:
            out += namer.end()
        if out is piece:
            return msg.UNCHANGED_RESPONSE_BODY
        return _new_body(out, len(piece), whole=self.whole)

    def _deadline(self, flight: Flight) -> ep.ProcessingResponse:
        """Envoy's total or per-try timeout fired before the response started."""
        machine = flight.machine
        if machine is None:
            return msg.UNCHANGED_RESPONSE_HEADERS
        # Envoy's per-try timeout while the first-token filter held the headers (or its 504
        # was on its way): the headers came in time, the first content did not.
        phase = Phase.FIRST_TOKEN if flight.opening is HELD or flight.opening is EXPIRED else None
        return self.refuse(machine.expired(phase).error)

    def refuse(
        self, error: WireError, extra: list[tuple[str, bytes]] | None = None
    ) -> ep.ProcessingResponse:
        assert self.wire is not None
        headers = [*(extra or []), *self._exposed()]
        if self.flight is not None:
            ctx = self.flight.ctx
            ctx.response_status = error.status
            if ctx.limit_headers is not None:  # admitted: the tenant's headers on every answer
                headers += _text(ctx.limit_headers)
        return msg.immediate(self.wire, error.status, error.error_type, error.message, headers)

    def _exposed(self) -> list[tuple[str, bytes]]:
        if self.flight is None or not self.p.server.expose_headers:
            return []
        return [(k.decode(), v) for k, v in exposed_headers(self.flight.ctx)]

    def _header(self, name: str) -> str | None:
        value = self.headers.get(name)
        return None if value is None else value.decode("latin-1")

    def _finish(self, admission: Admission, ctx: RequestContext) -> None:
        """Settle, keep or release the request's reservation (once), in a task of its own."""
        self.admission = None
        tenancy = self.p.tenancy
        assert tenancy is not None
        task = asyncio.get_running_loop().create_task(
            tenancy.end_request(admission, ctx, answered=self.answered)
        )
        _settling.add(task)
        task.add_done_callback(_settling.discard)

    def close(self, *, whole: bool = False) -> None:
        """Release an attempt nobody answered, report the usage read, end the request's
        telemetry (once); the stream takes no phase after this. `whole`: the answer's body
        ended (its attempt, when judged at its end, is settled as finished; so it is after
        the stream's own error, whatever came after)."""
        self.closed = True
        flight, span, self.flight, self.span = self.flight, self.span, None, None
        usage, self.usage = self.usage, None
        judging, self.judging = self.judging, None
        if flight is not None:
            ctx = flight.ctx
            if usage is not None:
                report_tokens(ctx, usage.end())  # however the body ended
            if judging is not None and (whole or ctx.upstream_status is not None):
                # Whole at the client, or ended by its own error (the cloud filter reported
                # it, and passes nothing after it): what the stream reported decides. A client
                # that leaves once it read the error event (an SDK raises on it) may close the
                # stream before Envoy sends the body's end here.
                judging.ended(How.FINISHED)
            if flight.machine is not None:
                flight.machine.closed()  # an attempt nobody answered goes back; spans end
            if self.admission is not None:
                self._finish(self.admission, ctx)
            self.flights.close(flight)
            # Under Envoy the request ends, for switchyard, at the end of the answer's body
            # when it is read, else at its response headers.
            request_metrics.observe(ctx, time.monotonic())
        if span is not None:
            if flight is not None:
                _annotate(span, flight.ctx)
            span.end()


_UPSTREAM_ID = UPSTREAM_REQUEST_ID.decode()


def _response_headers(
    http: ep.HttpHeaders,
) -> tuple[msg.Headers, list[str], list[tuple[bytes, bytes]]]:
    """In one pass over the answer's headers: those the router reads (`_READ_RESPONSE`, a
    repeated name keeps its first), the provider's own to remove from the answer and its
    request ids (`engine.provider_headers`)."""
    read: msg.Headers = {}
    removed: list[str] = []
    ids: list[tuple[bytes, bytes]] = []
    for header in http.headers.headers:
        key = header.key
        if key in _READ_RESPONSE and key not in read:
            read[key] = header.raw_value or header.value.encode()
        if key in WITHHELD_KEYS or key.startswith(WITHHELD_KEY_PREFIXES):
            removed.append(key)
        if key in REQUEST_ID_KEYS:  # Bedrock's is withheld too: both
            ids.append((REQUEST_ID_KEYS[key], header.raw_value))
    return read, removed, ids


def _new_body(body: bytes, was: int, *, whole: bool) -> ep.ProcessingResponse:
    """The answer to a body piece that changed; a whole body (BUFFERED, its headers still
    held) gets its new length."""
    answer = ep.ProcessingResponse()
    common = answer.response_body.response
    common.body_mutation.body = body
    if whole and len(body) != was:
        msg.fill(common, [msg.option("content-length", str(len(body)).encode())])
    return answer


_settling: set[asyncio.Task[object]] = set()
"""Settles under way (a stream's end is a plain call; a shared store's settle awaits)."""


def _text(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[str, bytes]]:
    return [(k.decode("latin-1"), v) for k, v in headers]


def upstream_path(client: Account, path: bytes) -> bytes:
    """The `:path` `client` is called on for the client's `path`: its path template filled
    (the client's query kept), or `path` itself when it has none."""
    if client.spec.path is None:
        return path
    base, _, query = path.decode("latin-1").partition("?")
    return with_query(client.upstream_path(base), query).encode("latin-1")


def _looks_local(headers: msg.Headers) -> bool:
    """Without `response.code_details`: Envoy's local replies carry no upstream service time."""
    return "x-envoy-upstream-service-time" not in headers and headers.get(
        "content-type", b""
    ).startswith(b"text/plain")


def _annotate(span: trace.Span, ctx: RequestContext) -> None:
    if span.is_recording():
        span.set_attributes(decision_attributes(ctx))
