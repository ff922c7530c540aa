"""CoolingMiddleware: picks the account for each upstream attempt and fails over on faults.

Every attempt runs the app once with `ctx.account` set to the account the pool chose. Its
`http.response.start` is held back only while a failover is still possible: a fault or a 429
that another account may absorb is swallowed and the same body replayed to the next account;
anything else goes to the client at once. Once a byte reached the client, there is no failover.

When no upstream answer can be passed on, it answers itself as the engine says
(`engine/answers.py`, the same through the ext_proc server): 429 `rate_limited` or 503
`no_healthy_account` with `retry-after` when no account can be tried, 502
`upstream_unreachable` when every attempt failed in transport, 504 `deadline_exceeded` when the
last such attempt ran out of time (the call's own timeout from `timeout_for` can beat the
deadline policy to it). When all accounts answered with errors, the client gets the last of
those answers unchanged.

A failed transport is seen two ways, as frameworks differ: an exception escaping the app
(Starlette and FastAPI re-raise it after answering their own 500), or the context's
`transport_error`, set by the client `make_http_client()` builds (Litestar and Django answer
their own 500 and never re-raise). Either way the framework's 5xx is not passed on: every 5xx
is held until the app ends, which costs nothing on the paths that answer well.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping

from opentelemetry import trace

from ..accounts import Account, build_accounts, pool_from_accounts
from ..config import ConfigSource, Server, as_config
from ..context import RequestContext
from ..core.clock import Clock, monotonic
from ..core.pool import AccountPool, Lease, Outcome
from ..engine import answers, attempts
from ..engine.answers import NO_HEALTHY_ACCOUNT, RATE_LIMITED, UPSTREAM_UNREACHABLE
from ..engine.attempts import APP_ERROR, OUT_OF_TIME
from ..engine.outcomes import throttle_headers
from ..engine.policies import Engine
from ..engine.variants import Canaries
from ..state import Store, build_store
from ..telemetry import names as tm
from ..telemetry import request_metrics
from ..wire import Wire
from ._base import PolicyMiddleware, send_error
from ._types import ASGIApp, Message, Receive, Scope, Send
from .admin import cooling_status_app as cooling_status_app  # re-exported for existing imports

__all__ = [
    "APP_ERROR",
    "MAX_HELD_BYTES",
    "NO_HEALTHY_ACCOUNT",
    "RATE_LIMITED",
    "UPSTREAM_UNREACHABLE",
    "CoolingMiddleware",
    "cooling_status_app",
]

MAX_HELD_BYTES = 1 << 20
"""A held error body larger than this is forwarded: failover gives way to bounded memory."""

Inner = Callable[[RequestContext, Scope, Receive, Send], Awaitable[None]]
_log = logging.getLogger(__name__)
# Read on every attempt: Enum member access is slow on Python 3.11.
_FAULT = Outcome.FAULT


class _Attempt:
    """The `send` of one attempt: forwards at once unless the response may be failed over."""

    __slots__ = (
        "_ctx",
        "_engine",
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

    def __init__(self, send: Send, engine: Engine, ctx: RequestContext, tried: list[str]) -> None:
        self._send = send
        self._engine, self._ctx, self._tried = engine, ctx, tried  # for `may_retry`
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
                retry = self._engine.may_retry(self._ctx, status, self._tried)
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

    `accounts` (instead of `config`) and `pool` share one pool between policies, and `engine`
    (instead of both) is how `SwitchyardStack` hands in its decisions. Requests for a model no
    account serves pass through untouched, as do requests that are not LLM calls.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        config: ConfigSource | None = None,
        environ: Mapping[str, str] | None = None,
        accounts: Mapping[str, Account] | None = None,
        pool: AccountPool | None = None,
        clock: Clock = monotonic,
        server: Server | None = None,
        engine: Engine | None = None,
    ) -> None:
        store: Store | None = None
        if engine is not None:
            accounts, pool = engine.accounts, engine.pool
        elif config is not None:
            if accounts is not None:
                raise TypeError("CoolingMiddleware takes config or accounts, not both")
            loaded = as_config(config)
            accounts = build_accounts(loaded, environ)
            server = server or loaded.server
            store = build_store(loaded.state) if pool is None else None
        elif accounts is None:
            raise TypeError("CoolingMiddleware needs config (or accounts)")
        super().__init__(app, server=server)
        if engine is None:
            if pool is None:
                pool = pool_from_accounts(accounts, clock=clock)
            engine = Engine(server=self.server, accounts=accounts, pool=pool)
        self.engine = engine
        self.accounts = engine.accounts
        self.pool = engine.pool
        request_metrics.watch(self.pool)  # `switchyard.account.state`
        self.inner: Inner = self._call_app
        """What each attempt runs: the app, or (in `SwitchyardStack`) the deadline policy's
        `handle` around it, called directly rather than through another ASGI layer."""
        self.store = store
        if store is not None:
            store.bind(self.pool)
            self._start = store.start  # needs the server's event loop

    @property
    def guard(self) -> Canaries | None:
        """The canaries every attempt's outcome is told to (their guards count them)."""
        return self.engine.canaries

    @guard.setter
    def guard(self, canaries: Canaries | None) -> None:
        self.engine.canaries = canaries

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
        wire, engine = ctx.wire, self.engine
        if wire is None or ctx.resolved_model is None:
            return await self.inner(ctx, scope, receive, send)
        # The usual first attempt, with nothing shared to ask: a plain call, no coroutine.
        lease = engine.lease_now(ctx)
        if lease is None:
            if not engine.places(ctx):
                return await self.inner(ctx, scope, receive, send)  # not ours to place
            lease = await engine.acquire(ctx)
        tried: list[str] = []
        last: tuple[list[Message], Account | None, str | None] | None = None
        failure: str | None = None  # how the last attempt that raised failed
        while lease is not None:
            if tried:
                tm.failovers.add(1, {tm.RESPONSE_MODEL: ctx.resolved_model or ""})
            tried.append(lease.account)
            attempt = _Attempt(send, engine, ctx, tried)
            if await self._attempt(ctx, lease, scope, receive, attempt):
                return
            failure = attempt.failure
            if attempt.held is not None:
                last = (attempt.held, ctx.account, ctx.resolved_model)
            if not engine.another_possible(ctx, tried):
                break
            lease = await engine.acquire(ctx, tried)
        if last is not None:
            # The last upstream answer says more than anything we could make up (a 429 keeps
            # its retry-after); the exposed headers name the account that gave it.
            held, ctx.account, ctx.resolved_model = last
            for message in held:
                await send(message)
            return
        await self._refuse(ctx, wire, send, failure, tried)

    async def _refuse(
        self, ctx: RequestContext, wire: Wire, send: Send, failure: str | None, tried: list[str]
    ) -> None:
        """Answer for the accounts when no upstream answer can be passed on."""
        headers: answers.Headers = ()
        if failure in OUT_OF_TIME:
            # The call's own timeout (`timeout_for`) or the deadline, whichever came first:
            # the app's framework may have answered before the deadline policy could.
            error = answers.deadline_exceeded("total")
        elif tried:
            error = answers.unreachable()
        else:
            error, headers = self.engine.nothing_serves(ctx)
        await send_error(send, wire, error.status, error.error_type, error.message, headers)

    async def _attempt(
        self, ctx: RequestContext, lease: Lease, scope: Scope, receive: Receive, attempt: _Attempt
    ) -> bool:
        """Run one attempt; False when it failed before reaching the client (fail over)."""
        engine = self.engine
        engine.start_attempt(ctx, lease)
        ctx.upstream_status = None
        ctx.deadline_phase = None
        ctx.transport_error = None
        # Without an SDK, no span at all: nothing to build, activate or end.
        span = engine.attempt_span(ctx, lease) if tm.tracing() else None
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
                self._settle(ctx, lease, span, attempt, gone="cancelled")
                raise
            except Exception as exc:
                if self._raised(ctx, lease, span, attempt, exc):
                    raise  # the response started, nobody waits, or the app is broken
                return False
            if attempt.held is not None and not attempt.complete:
                await attempt.flush()  # the app returned mid-body: pass on what it sent
            status = attempt.status
            if span is None and status is not None and engine.plain_success(ctx, status):
                engine.succeeded(lease, ctx.resolved_model)  # the hot path: nothing to show
                return True
            return await self._returned(ctx, lease, span, attempt)
        finally:
            if client_span is not None:
                _end_client_span(client_span, ctx, attempt)
            if span is not None:
                attempts.end_span(span, ctx.deadline_phase)

    def _raised(
        self,
        ctx: RequestContext,
        lease: Lease,
        span: trace.Span | None,
        attempt: _Attempt,
        exc: Exception,
    ) -> bool:
        """Settle an attempt whose app raised `exc`; whether to re-raise it (False: the
        attempt failed before reaching the client, fail over)."""
        if span is not None:
            # The type only: an exception's text may quote the request or the reply.
            span.set_attribute(tm.ERROR_TYPE, type(exc).__qualname__)
        gone = ctx.disconnected and not attempt.finished
        kind = attempts.error_kind(
            type(exc), deadline_phase=ctx.deadline_phase, transport_error=ctx.transport_error
        )
        model = ctx.resolved_model
        if gone or kind == APP_ERROR:
            # A client that left, or a bug in the app, says nothing about the account:
            # counting it would let one bad code path cool every account.
            self.engine.settle(lease, None, "disconnected" if gone else kind, model, span=span)
        else:
            self.engine.settle(lease, _FAULT, kind, model, span=span)
        if gone or attempt.forwarded or kind == APP_ERROR:
            return True
        attempt.held = None  # an unfinished answer is never passed on
        attempt.failure = kind
        _log.warning("account %s failed (%s)", lease.account, type(exc).__name__)
        return False

    async def _returned(
        self, ctx: RequestContext, lease: Lease, span: trace.Span | None, attempt: _Attempt
    ) -> bool:
        """Settle an attempt whose app returned; whether its answer reached the client."""
        error = ctx.transport_error
        if attempt.held is not None and error is not None and (attempt.status or 0) >= 500:
            # The framework answered the transport error itself (Litestar, Django): its
            # 5xx is no upstream answer, so it is dropped like an escaping exception.
            attempt.failure = attempts.error_kind(
                error, deadline_phase=ctx.deadline_phase, transport_error=error
            )
            self.engine.settle(lease, _FAULT, attempt.failure, ctx.resolved_model, span=span)
            attempt.held = None
            _log.warning("account %s failed (%s)", lease.account, error.__name__)
            return False
        if attempt.held is not None and not attempt.retry:
            await attempt.flush()  # a 5xx held only to see whether an exception followed
        self._settle(ctx, lease, span, attempt)
        return attempt.status is not None and attempt.held is None

    def _settle(
        self,
        ctx: RequestContext,
        lease: Lease,
        span: trace.Span | None,
        attempt: _Attempt,
        *,
        gone: str | None = None,
    ) -> None:
        """Give the lease back with what the ended attempt said about the account."""
        if gone is None and ctx.disconnected:
            gone = "disconnected"
        outcome, status = attempts.verdict(
            attempt.status,
            finished=attempt.finished,
            gone=gone,
            deadline_phase=ctx.deadline_phase,
            upstream_status=ctx.upstream_status,
        )
        self.engine.settle(
            lease, outcome, status, ctx.resolved_model, span=span, retry=attempt.retry_headers
        )


def _client_span(ctx: RequestContext, parent: trace.Span) -> trace.Span:
    client, view = ctx.account, ctx.view
    return tm.start_client_span(
        parent,
        model=ctx.resolved_model,
        base_url="" if client is None else client.base_url,
        max_tokens=None if view is None else view.max_tokens,
    )


def _end_client_span(span: trace.Span, ctx: RequestContext, attempt: _Attempt) -> None:
    status = ctx.upstream_status if ctx.upstream_status is not None else attempt.status
    attempts.end_client_span(span, ctx, status=status, failure=attempt.failure)


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
