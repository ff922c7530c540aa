"""CoolingMiddleware: picks the account for each upstream attempt and fails over on faults.

Every attempt runs the app once with `ctx.client` set to the account the pool chose. Its
`http.response.start` is held back only while a failover is still possible: a fault or a 429
that another account may absorb is swallowed and the same body replayed to the next account;
anything else goes to the client at once. Once a byte reached the client, there is no failover.

Status codes and error types this middleware answers with itself, in the wire's error format:
429 `rate_limited` (every account serving the model is held by a 429's retry time, or held and
cooling; no upstream is called, `retry-after` says when the earliest is back), 503
`no_healthy_account` (every account serving the model is cooling; `retry-after` says when
the earliest recovers), 502 `upstream_unreachable` (every attempt failed in transport, e.g.
connection refused, and no upstream answer exists to pass on) and 504 `deadline_exceeded` when
the last such attempt failed by running out of time (the call's own timeout from `timeout_for`
can beat the deadline policy to it). When all accounts answered with errors, the client gets
the last of those answers unchanged.

A failed transport is seen two ways, as frameworks differ: an exception escaping the app
(Starlette and FastAPI re-raise it after answering their own 500), or the context's
`transport_error`, set by the client `make_http_client()` builds (Litestar and Django answer
their own 500 and never re-raise). Either way the framework's 5xx is not passed on: every 5xx
is held until the app ends, which costs nothing on the paths that answer well.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping

import httpx
from opentelemetry import trace

from ..accounts import UpstreamClient, build_clients, pool_from_clients
from ..config import ConfigSource, Server, as_config
from ..context import RequestContext
from ..core.clock import Clock, monotonic
from ..core.pool import AccountPool, Lease, Outcome, classify_status
from ..engine.outcomes import hold, settle, throttle_headers
from ..engine.variants import Canaries
from ..state import Store, build_store
from ..telemetry import names as tm
from ..telemetry import request_metrics
from ..wire import Wire
from ._base import PolicyMiddleware, send_error
from ._types import ASGIApp, Message, Receive, Scope, Send
from .admin import cooling_status_app as cooling_status_app  # re-exported for existing imports
from .deadline import DEADLINE_EXCEEDED

NO_HEALTHY_ACCOUNT = "no_healthy_account"
RATE_LIMITED = "rate_limited"
UPSTREAM_UNREACHABLE = "upstream_unreachable"
APP_ERROR = "app_error"
"""An exception that is not a transport error or a deadline: the app's own bug, not a fault."""
MAX_HELD_BYTES = 1 << 20
"""A held error body larger than this is forwarded: failover gives way to bounded memory."""

Inner = Callable[[RequestContext, Scope, Receive, Send], Awaitable[None]]
_ACCOUNT_PHASES = frozenset({"total", "headers", "idle"})  # a deadline that is the account's fault
_OUT_OF_TIME = frozenset({"deadline", "timeout"})  # failures answered 504, not 502
_log = logging.getLogger(__name__)
# Read on every attempt: Enum member access is slow on Python 3.11.
_SUCCESS, _THROTTLE = Outcome.SUCCESS, Outcome.THROTTLE


class _Attempt:
    """The `send` of one attempt: forwards at once unless the response may be failed over."""

    __slots__ = (
        "_cooling",
        "_ctx",
        "_send",
        "_tried",
        "complete",
        "failure",
        "finished",
        "forwarded",
        "held",
        "retry",
        "retry_headers",
        "size",
        "status",
    )

    def __init__(
        self, send: Send, cooling: CoolingMiddleware, ctx: RequestContext, tried: list[str]
    ) -> None:
        self._send = send
        self._cooling, self._ctx, self._tried = cooling, ctx, tried  # for `_may_retry`
        self.status: int | None = None
        self.forwarded = False
        self.finished = False  # the client has the whole response
        self.held: list[Message] | None = None
        self.size = 0  # bytes held
        self.complete = False  # the held response is whole: it can be swallowed
        self.retry_headers: list[tuple[str, str]] | None = None  # a 429's, for its hold
        self.retry = False  # held for a failover, not only to see whether an error follows
        self.failure: str | None = None  # why it failed before reaching the client

    async def send(self, message: Message) -> None:
        if self.held is None:
            if message["type"] == "http.response.start" and self.status is None:
                status = self.status = message["status"]
                if status == 429:
                    self.retry_headers = throttle_headers(message.get("headers", ()))
                # Every 5xx is held too, until the app ends: Starlette's and FastAPI's error
                # middleware answer an escaping exception with a 500 and then re-raise it, and
                # a transport error is no upstream answer to pass on.
                retry = self._cooling._may_retry(self._ctx, status, self._tried)
                if retry or status >= 500:
                    self.retry = retry
                    self.held = [message]
                    return
            self.forwarded = True
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                self.finished = True
            await self._send(message)
            return
        self.held.append(message)
        if message["type"] == "http.response.body":
            self.size += len(message.get("body", b""))
            if not message.get("more_body", False):
                self.complete = True
            elif self.size > MAX_HELD_BYTES:
                await self.flush()

    async def flush(self) -> None:
        held, self.held = self.held or [], None
        for message in held:
            await self.send(message)  # no longer held: each passes on, noted as it goes


class CoolingMiddleware(PolicyMiddleware):
    """Chooses an account per attempt, cools faulty ones, fails over.

    Alone, build it from the config (a `Config` or the path of its TOML file), as any
    framework adds a middleware: `app.add_middleware(CoolingMiddleware, config="s.toml")`.
    The accounts are its `[llm_clients]` (keys read from `environ`, default `os.environ`, now),
    and `[state]` says where their health lives; a store it built connects on the first ASGI
    call and closes at lifespan shutdown or `aclose()`.

    `clients` (instead of `config`) and `pool` are how `switchyard_stack` shares one pool
    between policies. Requests for a model no account serves pass through untouched, as do
    requests that are not LLM calls.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        config: ConfigSource | None = None,
        environ: Mapping[str, str] | None = None,
        clients: Mapping[str, UpstreamClient] | None = None,
        pool: AccountPool | None = None,
        clock: Clock = monotonic,
        server: Server | None = None,
    ) -> None:
        store: Store | None = None
        if config is not None:
            if clients is not None:
                raise TypeError("CoolingMiddleware takes config or clients, not both")
            loaded = as_config(config)
            clients = build_clients(loaded, environ)
            server = server or loaded.server
            store = build_store(loaded.state) if pool is None else None
        elif clients is None:
            raise TypeError("CoolingMiddleware needs config (or clients)")
        super().__init__(app, server=server)
        self.clients = dict(clients)
        self.pool = pool if pool is not None else pool_from_clients(self.clients, clock=clock)
        request_metrics.watch(self.pool)  # `switchyard.account.state`
        self.guard: Canaries | None = None
        """The canaries to tell every attempt's outcome (their guards count them); the stack
        sets its variant policy's."""
        self.inner: Inner = self._call_app
        """What each attempt runs: the app, or (in `SwitchyardStack`) the deadline policy's
        `handle` around it, called directly rather than through another ASGI layer."""
        self.store = store
        if store is not None:
            store.bind(self.pool)
            self._start = store.start  # needs the server's event loop

    async def aclose(self) -> None:
        """Close the state store this middleware built from its config (none otherwise)."""
        if self.store is not None:
            await self.store.aclose()

    async def other(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan" or self.store is None:
            return await self.app(scope, receive, send)

        async def send_closing(message: Message) -> None:
            if message["type"] == "lifespan.shutdown.complete":
                await self.aclose()
            await send(message)

        await self.app(scope, receive, send_closing)

    async def _call_app(
        self, ctx: RequestContext, scope: Scope, receive: Receive, send: Send
    ) -> None:
        await self.app(scope, receive, send)

    async def handle(self, ctx: RequestContext, scope: Scope, receive: Receive, send: Send) -> None:
        model, wire = ctx.resolved_model, ctx.wire
        if wire is None or model is None:
            return await self.inner(ctx, scope, receive, send)
        pool = self.pool
        # The usual first attempt, with nothing shared to ask: a plain call, no coroutine.
        lease = None if pool.shared else pool.acquire(model)
        if lease is None:
            if not pool.accounts_for(model) and self._fallback(ctx) is None:
                return await self.inner(ctx, scope, receive, send)  # not ours to place
            lease = await self._acquire(ctx, [])
        tried: list[str] = []
        last: tuple[list[Message], UpstreamClient | None, str | None] | None = None
        failure: str | None = None  # how the last attempt that raised failed
        while lease is not None:
            if tried:
                tm.failovers.add(1, {"route_model": ctx.resolved_model or ""})
            tried.append(lease.account)
            attempt = _Attempt(send, self, ctx, tried)
            if await self._attempt(ctx, lease, scope, receive, attempt):
                return
            failure = attempt.failure
            if attempt.held is not None:
                last = (attempt.held, ctx.client, ctx.resolved_model)
            if not self._another_possible(ctx, tried):
                break
            lease = await self._acquire(ctx, tried)
        if last is not None:
            # The last upstream answer says more than anything we could make up (a 429 keeps
            # its retry-after); the exposed headers name the account that gave it.
            held, ctx.client, ctx.resolved_model = last
            for message in held:
                await send(message)
        elif failure in _OUT_OF_TIME:
            # The call's own timeout (`timeout_for`) or the deadline, whichever came first:
            # the app's framework may have answered before the deadline policy could.
            text = "the upstream attempt did not finish within its deadline"
            await send_error(send, wire, 504, DEADLINE_EXCEEDED, text)
        elif tried:
            text = "no upstream account could be reached"
            await send_error(send, wire, 502, UPSTREAM_UNREACHABLE, text)
        else:
            await self._no_healthy_account(ctx, wire, send)

    async def _attempt(
        self, ctx: RequestContext, lease: Lease, scope: Scope, receive: Receive, attempt: _Attempt
    ) -> bool:
        """Run one attempt; False when it failed before reaching the client (fail over)."""
        ctx.client = self.clients[lease.account]
        ctx.attempts += 1
        ctx.upstream_status = None
        ctx.deadline_phase = None
        ctx.transport_error = None
        # Without an SDK, no span at all: nothing to build, activate or end.
        span = _attempt_span(ctx, lease) if tm.tracing() else None
        client_span = None
        try:
            try:
                if span is None:
                    await self.inner(ctx, scope, _replay(ctx, receive), attempt.send)
                else:
                    client_span = _client_span(ctx, span)
                    with tm.activate(client_span):  # the app's own call spans nest under it
                        await self.inner(ctx, scope, _replay(ctx, receive), attempt.send)
            except asyncio.CancelledError:
                # A response already sent whole still has its outcome (uvicorn reports a
                # disconnect once a response completes, and the base cancels then).
                self._settle(lease, span, *_verdict(ctx, attempt, gone="cancelled"), ctx)
                raise
            except Exception as exc:
                if span is not None:
                    # The type only: an exception's text may quote the request or the reply.
                    span.set_attribute(tm.ERROR_TYPE, type(exc).__qualname__)
                gone = ctx.disconnected and not attempt.finished
                kind = _error_kind(ctx, type(exc))
                if gone or kind == APP_ERROR:
                    # A client that left, or a bug in the app, says nothing about the
                    # account: counting it would let one bad code path cool every account.
                    self._settle(lease, span, None, "disconnected" if gone else kind, ctx)
                else:
                    self._settle(lease, span, Outcome.FAULT, kind, ctx)
                if gone or attempt.forwarded or kind == APP_ERROR:
                    raise  # the response started, nobody waits, or the app is broken
                attempt.held = None  # an unfinished answer is never passed on
                attempt.failure = kind
                _log.warning("account %s failed (%s)", lease.account, type(exc).__name__)
                return False
            if attempt.held is not None and not attempt.complete:
                await attempt.flush()  # the app returned mid-body: pass on what it sent
            status = attempt.status
            if span is None and status is not None and _plain_success(ctx, status):
                self.pool.record(lease, _SUCCESS)  # the hot path: nothing to count or annotate
                if self.guard is not None and ctx.resolved_model is not None:
                    self.guard.record(ctx.resolved_model, fault=False)
                return True
            error = ctx.transport_error
            if attempt.held is not None and error is not None and (status or 0) >= 500:
                # The framework answered the transport error itself (Litestar, Django): its
                # 5xx is no upstream answer, so it is dropped like an escaping exception.
                attempt.failure = _error_kind(ctx, error)
                self._settle(lease, span, Outcome.FAULT, attempt.failure, ctx)
                attempt.held = None
                _log.warning("account %s failed (%s)", lease.account, error.__name__)
                return False
            if attempt.held is not None and not attempt.retry:
                await attempt.flush()  # a 5xx held only to see whether an exception followed
            outcome, status_text = _verdict(ctx, attempt)
            self._settle(lease, span, outcome, status_text, ctx)
            if outcome is _THROTTLE and attempt.retry_headers and ctx.resolved_model is not None:
                hold(self.pool, lease.account, ctx.resolved_model, attempt.retry_headers)
            return attempt.status is not None and attempt.held is None
        finally:
            if client_span is not None:
                _end_client_span(client_span, ctx, attempt)
            if span is not None:
                if ctx.deadline_phase is not None:
                    span.set_attribute(tm.DEADLINE_PHASE, ctx.deadline_phase)
                span.end()

    def _settle(
        self,
        lease: Lease,
        span: trace.Span | None,
        outcome: Outcome | None,
        status: str,
        ctx: RequestContext,
    ) -> None:
        """Give the lease back with what the attempt said about the account's health."""
        if self.guard is not None and outcome is not None and ctx.resolved_model is not None:
            self.guard.record(ctx.resolved_model, fault=outcome is Outcome.FAULT)
        if span is not None and span.is_recording():
            span.set_attributes(
                {
                    tm.ATTEMPT_STATUS: status,
                    tm.ATTEMPT_OUTCOME: outcome.value if outcome else "none",
                }
            )
            if outcome is Outcome.FAULT:
                span.set_status(trace.StatusCode.ERROR, status)
        settle(self.pool, lease, outcome, status)

    def _may_retry(self, ctx: RequestContext, status: int, tried: list[str]) -> bool:
        """Whether a response starting with `status` should be held for a failover."""
        if _plain_success(ctx, status):
            return False
        if ctx.deadline_phase == "budget":
            return False  # the caller's budget ran out: no account is to blame
        outcome, _ = _outcome(ctx, status)
        return outcome is not Outcome.SUCCESS and self._another_possible(ctx, tried)

    def _another_possible(self, ctx: RequestContext, tried: list[str]) -> bool:
        """Whether one more attempt could start now; peeks without claiming a probe slot."""
        if ctx.disconnected or (ctx.budget_at is not None and time.monotonic() >= ctx.budget_at):
            return False
        models = [ctx.resolved_model, self._fallback(ctx)]
        for model in models:
            if model is None:
                continue
            untried = set(self.pool.accounts_for(model)).difference(tried)
            if untried and self.pool.retry_after_secs(model, allowed=untried) == 0.0:
                return True
        return False

    async def _acquire(self, ctx: RequestContext, tried: list[str]) -> Lease | None:
        # aacquire: with shared state, a probe is claimed across replicas before it is sent.
        pool = self.pool
        model = ctx.resolved_model
        lease = None
        if model is not None:
            lease = (
                await pool.aacquire(model, exclude=tried)
                if pool.shared
                else pool.acquire(model, exclude=tried)
            )
        fallback = self._fallback(ctx) if lease is None else None
        if fallback is not None:
            lease = await pool.aacquire(fallback, exclude=tried)
            if lease is not None:
                ctx.resolved_model = fallback  # `body_for_app()` rewrites the body to match
        return lease

    def _fallback(self, ctx: RequestContext) -> str | None:
        """The canary's base model, if it may take over (`ctx.canary_base`) and is served."""
        base = ctx.canary_base()
        return base if base is not None and self.pool.accounts_for(base) else None

    async def _no_healthy_account(self, ctx: RequestContext, wire: Wire, send: Send) -> None:
        waits = [
            self.pool.retry_after_secs(model)
            for model in (ctx.resolved_model, self._fallback(ctx))
            if model is not None
        ]
        wait = min((w for w in waits if w is not None), default=1.0)
        retry_after = [(b"retry-after", str(max(1, math.ceil(wait))).encode())]
        model = ctx.resolved_model
        if model is not None and self.pool.throttled(model):
            message = f"every upstream account for model {model!r} is rate limited"
            await send_error(send, wire, 429, RATE_LIMITED, message, retry_after)
            return
        message = f"no healthy upstream account for model {model!r}"
        await send_error(send, wire, 503, NO_HEALTHY_ACCOUNT, message, retry_after)


def _attempt_span(ctx: RequestContext, lease: Lease) -> trace.Span:
    span = tm.tracer.start_span(tm.SPAN_ATTEMPT)
    if span.is_recording():
        attributes: dict[str, str | bool] = {
            tm.ACCOUNT: lease.account,
            tm.ATTEMPT_PROBE: lease.probe,
        }
        if ctx.client is not None and (provider := tm.provider_name(ctx.client.base_url)):
            attributes[tm.PROVIDER_NAME] = provider
        span.set_attributes(attributes)
    return span


def _client_span(ctx: RequestContext, parent: trace.Span) -> trace.Span:
    client, view = ctx.client, ctx.view
    return tm.start_client_span(
        parent,
        model=ctx.resolved_model,
        base_url="" if client is None else client.base_url,
        max_tokens=None if view is None else view.max_tokens,
    )


def _end_client_span(span: trace.Span, ctx: RequestContext, attempt: _Attempt) -> None:
    status = ctx.upstream_status if ctx.upstream_status is not None else attempt.status
    if ctx.deadline_phase is not None:
        error: str | None = "deadline_exceeded"
    elif attempt.failure is not None:
        error = attempt.failure
    elif status is None:
        error = "no_response"
    else:
        error = str(status) if status >= 400 else None
    tm.end_client_span(
        span,
        model=ctx.resolved_model,
        error=error,
        input_tokens=ctx.input_tokens,
        output_tokens=ctx.output_tokens,
    )


def _verdict(
    ctx: RequestContext, attempt: _Attempt, *, gone: str | None = None
) -> tuple[Outcome | None, str]:
    """What an ended attempt says about its account; None: nothing (release the lease).

    `gone` names why the app was cancelled; a response already sent whole still counts.
    """
    if (gone or ctx.disconnected) and not attempt.finished:
        return None, gone or "disconnected"
    if attempt.status is None:
        return Outcome.FAULT, "no_response"
    if ctx.deadline_phase == "budget":
        return None, "budget"  # the caller's budget ran out, whoever answered
    return _outcome(ctx, attempt.status)


def _plain_success(ctx: RequestContext, status: int) -> bool:
    """A success for sure: every fault and throttle is a 4xx/5xx, a deadline or a departure."""
    return (
        status < 400
        and ctx.upstream_status is None
        and ctx.deadline_phase is None
        and not ctx.disconnected
    )


def _outcome(ctx: RequestContext, status: int) -> tuple[Outcome, str]:
    """An attempt's outcome and its status as metrics show it."""
    if ctx.deadline_phase in _ACCOUNT_PHASES:
        return Outcome.FAULT, "deadline"
    status = ctx.upstream_status if ctx.upstream_status is not None else status
    return classify_status(status), str(status)


def _error_kind(ctx: RequestContext, error: type[BaseException]) -> str:
    """The `status` metrics show for an attempt that ended in `error` (raised or reported)."""
    if ctx.deadline_phase in _ACCOUNT_PHASES:
        return "deadline"
    if issubclass(error, httpx.ConnectError | httpx.ConnectTimeout | ConnectionError):
        return "connect_error"
    if issubclass(error, httpx.TimeoutException):
        return "timeout"
    if issubclass(error, httpx.TransportError | OSError):
        return "transport_error"
    if ctx.transport_error is error:
        return "transport_error"  # reported by the app, in its own client's terms
    if ctx.transport_error is not None:
        # Not a transport error itself, but raised after one (an app that wraps the error
        # in its own): the account is what failed.
        return _error_kind(ctx, ctx.transport_error)
    return APP_ERROR


def _replay(ctx: RequestContext, receive: Receive) -> Receive:
    """A fresh `receive` per attempt: the body once, then whatever `receive` says next.

    The body comes from `ctx.body_for_app()`, so every attempt reads the same bytes (with the
    model rewrite). What `receive` itself still holds of the body is skipped: only a
    disconnect can follow.
    """
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": ctx.body_for_app(), "more_body": False}
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return message

    return replay
