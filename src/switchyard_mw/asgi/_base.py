"""What every switchyard middleware shares: reading the request once, the context, the headers.

The first switchyard middleware a request meets owns it: it reads the body (bounded), parses
the view, creates the context, sets the ContextVar for the app, adds the `x-switchyard-*`
headers to the response and ends the request's telemetry. The others find the context and run
their policy only.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable

from opentelemetry import propagate, trace
from opentelemetry.propagators.textmap import Getter

from ..config import Server
from ..context import RequestContext, context_of, current_var, decision_attributes
from ..core.deadline_math import BUDGET_HEADERS
from ..engine.answers import exposed_headers
from ..engine.budget import budget_end
from ..engine.paths import json_media, llm_paths, llm_wire
from ..request_body import ClientDisconnected, read_body
from ..telemetry import names as tm
from ..telemetry import request_metrics
from ..wire import Wire, WireError, read_request, too_large
from ._disconnect import running_loop
from ._types import ASGIApp, Message, Receive, Scope, Send
from .exchange import EXCHANGE_KEY, Cause, Exchange, Stage
from .exchange import send_error as send_error  # its home before the exchange


class PolicyMiddleware(ABC):
    """Base of the four policy middlewares; `handle` runs the policy around the app."""

    def __init__(self, app: ASGIApp, *, server: Server | None = None) -> None:
        self.app = app
        self.server = server or Server()
        self._paths: dict[str, Wire] = llm_paths(self.server)

    _start: Callable[[], Awaitable[None]] | None = None
    """Awaited once, on the first ASGI call (e.g. connecting a store in the server's loop)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._start is not None:
            start, self._start = self._start, None
            await start()
        if scope["type"] != "http":
            return await self.other(scope, receive, send)
        ctx = context_of(scope)
        if ctx is not None:
            return await self.handle(ctx, scope, receive, send)
        # The owner's work. Its steps are plain calls where they can be: this runs on every
        # request, and each coroutine layer costs.
        path = self._path_of(scope) if scope.get("root_path") else scope["path"]
        wire = llm_wire(self._paths, scope.get("method", ""), path)
        ex: Exchange | None = None
        if wire is None:
            ctx = RequestContext()
        else:
            read = await self._read(scope, receive, send, wire, path)
            if read is None:
                return  # answered already (or the client left): no app to call
            ctx, ex = read
        state = scope.setdefault("state", {})
        state["switchyard"] = ctx
        ctx.headers = scope["headers"]  # only a record reads them (the client's x-request-id)
        # Without an SDK, no span work at all: nothing to look up, start, activate or end.
        traced = tm.tracing()
        span, own_span, annotate = _telemetry(scope, ctx) if traced else _NO_SPANS
        if ex is not None:
            state[EXCHANGE_KEY] = ex
            ex.traced = traced  # asked once: the policies read it here
            ex.expose, ex.last = self.server.expose_headers, annotate
            receive, send = ex.receive, ex.send
        elif self.server.expose_headers or annotate is not None:
            send = _tracking(ctx, send, expose=self.server.expose_headers, last=annotate)
        token = current_var.set(ctx)
        failure = None
        try:
            if span is None:
                await self.handle(ctx, scope, receive, send)
            else:
                with tm.activate(span):
                    await self.handle(ctx, scope, receive, send)
        except asyncio.CancelledError:
            # Ours only for a client that left, and if nobody else cancelled the task too:
            # finished here, since nobody is there to answer.
            if ex is None or ex.whose() is not Cause.CLIENT_LEFT:
                raise
        except Exception as exc:
            failure = type(exc).__qualname__  # the type only: its text may quote a prompt
            raise
        finally:
            if ex is not None:
                # The exchange holds the server's `receive`/`send` (uvicorn's are bound to the
                # object holding this scope) and the request's task: kept in the scope past the
                # request, all of it would be a cycle only the garbage collector frees. Only
                # the policies read it, while they run; the context stays for the app's own.
                del state[EXCHANGE_KEY]
            _finish(ctx, token, ex, failure, annotate, own_span)

    async def _read(
        self, scope: Scope, receive: Receive, send: Send, wire: Wire, path: str
    ) -> tuple[RequestContext, Exchange | None] | None:
        """Read an LLM call's body (bounded in size and time) into its context, and start
        its exchange; None when the request was answered here instead. A body that is not
        JSON is not read: the design passes it through."""
        content_type, length, budgeted = _sniff(scope)
        if not json_media(content_type):
            return RequestContext(), None
        loop = running_loop()
        task = asyncio.current_task(loop)
        started = time.monotonic()
        # The whole body must arrive in time: a client that sends it slowly, or stops
        # halfway, would otherwise hold the request (and what it sent) forever. The exchange
        # times the read, then watches for the client leaving.
        secs = None if task is None else self.server.body_read_timeout_secs
        ex = Exchange(receive, send, loop, task, secs, started)
        limit = self.server.max_body_bytes
        try:
            try:
                if length is not None and length.strip().isdigit() and int(length) > limit:
                    raise too_large(limit)
                message = await receive()
                if message["type"] == "http.request" and not message.get("more_body", False):
                    body = message.get("body", b"")  # the usual case: one message has it all
                    if len(body) > limit:
                        raise too_large(limit)
                else:
                    body = await read_body(receive, limit=limit, first=message)
                ctx = RequestContext(read_request(wire, body, path), body, started)
            except BaseException:
                ex.stop()
                raise
        except ClientDisconnected:
            return None
        except asyncio.CancelledError:
            if ex.whose() is not Cause.READ_TIMEOUT:
                raise
            await send_error(send, wire, *_read_timeout(self.server), _CLOSE)
            return None
        except WireError as exc:
            await send_error(send, wire, exc.status, exc.error_type, exc.message)
            return None
        ex.read(ctx)
        if budgeted:
            ctx.budget_at = budget_end(functools.partial(_first, scope), ctx.started_at)
        return ctx, ex

    @abstractmethod
    def handle(
        self, ctx: RequestContext, scope: Scope, receive: Receive, send: Send
    ) -> Awaitable[None]:
        """Run this policy for one request, calling `self.app` (or answering itself): a
        coroutine, or a plain call handing back what to await (the stack's usual request)."""

    async def other(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A scope that is not an HTTP request (lifespan, websocket): passed to the app."""
        await self.app(scope, receive, send)

    @staticmethod
    def _path_of(scope: Scope) -> str:
        """The request's path under the app's root (the LLM paths are matched against it)."""
        path: str = scope["path"]
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]
        return path


_TYPE = b"content-type"
_LENGTH = b"content-length"
_WANTED = frozenset({_TYPE, _LENGTH, *BUDGET_HEADERS})
_NO_SPANS: tuple[None, None, None] = (None, None, None)
_ENDED = Stage.ENDED


def _sniff(scope: Scope) -> tuple[bytes | None, bytes | None, bool]:
    """The request's content-type and content-length (first of each), and whether it carries
    a budget header: one pass over its headers."""
    content_type = length = None
    budgeted = False
    for key, value in scope.get("headers", ()):
        if key in _WANTED:
            if key == _TYPE:
                if content_type is None:
                    content_type = value
            elif key == _LENGTH:
                if length is None:
                    length = value
            else:
                budgeted = True
    return content_type, length, budgeted


def _telemetry(
    scope: Scope, ctx: RequestContext
) -> tuple[trace.Span, trace.Span | None, Callable[[], None] | None]:
    """The request's span, the one switchyard started for it (if any), and what puts the
    request's decisions on it (None when the span records nothing)."""
    span, own_span = _request_span(scope)
    annotate = None
    if span.is_recording():
        annotate = functools.partial(
            _annotate, span, ctx, own=own_span is not None, method=scope.get("method")
        )
    return span, own_span, annotate


def _finish(
    ctx: RequestContext,
    token: contextvars.Token[RequestContext | None],
    ex: Exchange | None,
    failure: str | None,
    annotate: Callable[[], None] | None,
    own_span: trace.Span | None,
) -> None:
    """The request's end, however it ended: stop watching, reset the context, end its
    telemetry (`failure`: the type of an exception that escaped)."""
    if ex is not None and ex.stage is not _ENDED:
        ex.stop()
    current_var.reset(token)
    if ctx.view is not None:
        request_metrics.observe(ctx, time.monotonic(), failure)
    if annotate is not None:
        annotate()  # again: what changed after the response (or with no response)
    if own_span is not None:  # an instrumentation's span records its own exceptions
        if failure is not None:
            own_span.set_attribute(tm.ERROR_TYPE, failure)
            own_span.set_status(trace.StatusCode.ERROR)
        own_span.end()


def _first(scope: Scope, name: bytes) -> bytes | None:
    """The first value of request header `name` (lower case), or None."""
    for key, value in scope.get("headers", ()):
        if key == name:
            found: bytes = value
            return found
    return None


REQUEST_TIMEOUT = "request_timeout"
_CLOSE = ((b"connection", b"close"),)
"""On a 408 the rest of the body may still come: the connection is not reused (as Envoy's and
nginx's request timeouts do)."""


def _read_timeout(server: Server) -> tuple[int, str, str]:
    secs = server.body_read_timeout_secs
    return 408, REQUEST_TIMEOUT, f"the request body did not arrive within {secs:g} s"


def _tracking(
    ctx: RequestContext,
    send: Send,
    *,
    expose: bool,
    last: Callable[[], None] | None = None,
) -> Send:
    """For a request without an exchange (not an LLM call switchyard read): adds the
    `x-switchyard-*` headers and notes the status for the request's span.

    `last` runs just before the response's last message: an ASGI instrumentation ends its
    span as that message passes, so the request's attributes must be on it by then.
    """

    async def send_tracked(message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            ctx.response_status = message["status"]
            if expose and (extra := exposed_headers(ctx)):
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
        elif last is not None and kind == "http.response.body" and not message.get("more_body"):
            last()
        await send(message)

    return send_tracked


class _ScopeHeaders(Getter[Scope]):
    """Reads propagation headers (`traceparent`, ...) straight from an ASGI scope."""

    def get(self, carrier: Scope, key: str) -> list[str] | None:
        name = key.lower().encode("latin-1")
        found = [v.decode("latin-1") for k, v in carrier.get("headers", ()) if k.lower() == name]
        return found or None

    def keys(self, carrier: Scope) -> list[str]:
        return [k.decode("latin-1") for k, _ in carrier.get("headers", ())]


_SCOPE_HEADERS = _ScopeHeaders()


def _request_span(scope: Scope) -> tuple[trace.Span, trace.Span | None]:
    """The span the request's decisions go on, and the one switchyard started for it if it
    had to (no ASGI instrumentation above us): that one continues the caller's trace
    (`traceparent`) unless a span above us already did."""
    span = trace.get_current_span()
    if span.is_recording():
        return span, None
    parent = None
    if not span.get_span_context().is_valid:
        parent = propagate.extract(scope, getter=_SCOPE_HEADERS)
    own = tm.tracer.start_span(tm.SPAN_REQUEST, context=parent, kind=trace.SpanKind.SERVER)
    return own, own


def _annotate(span: trace.Span, ctx: RequestContext, *, own: bool, method: str | None) -> None:
    """The request's decisions on its span; `own`: switchyard's own span, which also gets the
    HTTP attributes an ASGI instrumentation would otherwise have set."""
    if not span.is_recording():
        return
    attributes: dict[str, str | int] = {}
    if own:
        if method is not None:
            attributes[tm.HTTP_METHOD] = method
        if ctx.response_status is not None:
            attributes[tm.HTTP_STATUS] = ctx.response_status
            if ctx.response_status >= 500:  # server spans: only 5xx are the server's errors
                attributes[tm.ERROR_TYPE] = str(ctx.response_status)
                span.set_status(trace.StatusCode.ERROR)
    attributes.update(decision_attributes(ctx))
    span.set_attributes(attributes)
