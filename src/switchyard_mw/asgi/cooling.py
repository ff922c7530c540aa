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

from ..accounts import Account, build_accounts, pool_from_accounts
from ..config import ConfigSource, Server, as_config
from ..context import RequestContext
from ..core.clock import Clock, monotonic
from ..core.pool import AccountPool
from ..engine.answers import NO_HEALTHY_ACCOUNT, RATE_LIMITED, UPSTREAM_UNREACHABLE
from ..engine.attempts import APP_ERROR
from ..engine.claims import claimed
from ..engine.fallbacks import Chains
from ..engine.machine import (
    DONE,
    FORWARD,
    NEXT,
    PASS_THROUGH,
    Action,
    AttemptMachine,
    ClaimProbe,
    Deliver,
    Gone,
    How,
    Refuse,
    State,
    Wait,
)
from ..engine.machine import Send as SendOn
from ..engine.policies import Engine
from ..engine.variants import Canaries
from ..state import Store, build_store
from ..telemetry import names as tm
from ..telemetry import request_metrics
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
_FINISHED, _RETURNED, _RAISED, _GONE = How.FINISHED, How.RETURNED, How.RAISED, How.GONE
_CANCELLED = Gone.CANCELLED


class _Attempt:
    """The `send` of one attempt: forwards at once unless the machine holds the answer back."""

    __slots__ = (
        "_machine",
        "_send",
        "complete",
        "content",
        "finished",
        "held",
        "size",
        "started",
    )

    def __init__(self, send: Send, machine: AttemptMachine) -> None:
        self._send = send
        self._machine = machine
        self.started = False
        self.finished = False  # the client has the whole response
        self.held: list[Message] | None = None
        self.size = 0  # bytes held
        self.complete = False  # the held response is whole: it can be swallowed
        self.content = False  # the machine heard of the answer's first content

    async def send(self, message: Message) -> None:
        if self.held is None:
            if message["type"] == "http.response.start" and not self.started:
                self.started = True
                # Held while a failover is possible, and every 5xx until the app ends:
                # Starlette's and FastAPI's error middleware answer an escaping exception with
                # a 500 and then re-raise it, and a transport error is no upstream answer.
                action = self._machine.started(message["status"], message.get("headers", ()))
                if action is not FORWARD:
                    self.held = [message]
                    return
            if message["type"] == "http.response.body":
                if not self.content:
                    self._first_content()
                if not message.get("more_body", False):
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

    def _first_content(self) -> None:
        """The deadline policy holds a stream back until its first content event and notes
        it (`ctx.first_token_at`): the machine hears of it as that content passes."""
        machine = self._machine
        if machine.ctx.first_token_at is not None and machine.state is State.FORWARDING:
            self.content = True
            machine.first_content()

    async def flush(self) -> None:
        """Stop holding: what was held goes on, and no failover can follow."""
        self._machine.cannot_hold()
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
        chains: Chains | None = None
        if engine is not None:
            accounts, pool = engine.accounts, engine.pool
        elif config is not None:
            if accounts is not None:
                raise TypeError("CoolingMiddleware takes config or accounts, not both")
            loaded = as_config(config)
            accounts = build_accounts(loaded, environ)
            server = server or loaded.server
            store = build_store(loaded.state) if pool is None else None
            chains = Chains(loaded.fallbacks)
        elif accounts is None:
            raise TypeError("CoolingMiddleware needs config (or accounts)")
        super().__init__(app, server=server)
        if engine is None:
            if pool is None:
                pool = pool_from_accounts(accounts, clock=clock)
            engine = Engine(server=self.server, accounts=accounts, pool=pool, chains=chains)
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
        wire = ctx.wire
        if wire is None or ctx.resolved_model is None:
            return await self.inner(ctx, scope, receive, send)
        # Without an SDK, no span at all: nothing to build, activate or end.
        machine = AttemptMachine(self.engine, ctx, tm.tracing(), None, True)
        action: Action = machine.begin()  # the usual first attempt: a plain call
        while True:
            if isinstance(action, SendOn):
                action = await self._attempt(ctx, machine, action, scope, receive, send)
            elif action is NEXT:
                action = machine.next()
            elif isinstance(action, ClaimProbe):
                action = await claimed(machine, action)
            elif isinstance(action, Wait):
                # Retry in place: the wait ends inside the caller's budget (the machine saw
                # to it); a client that leaves meanwhile cancels it with the request.
                await asyncio.sleep(action.secs)
                action = machine.waited()
            else:
                break
        if isinstance(action, Deliver):
            held: list[Message] = action.held  # type: ignore[assignment]  # ours, from ended()
            for message in held:
                await send(message)
        elif isinstance(action, Refuse):
            error = action.error
            await send_error(
                send, wire, error.status, error.error_type, error.message, action.headers
            )
        elif action is PASS_THROUGH:
            await self.inner(ctx, scope, receive, send)  # not ours to place

    async def _attempt(
        self,
        ctx: RequestContext,
        machine: AttemptMachine,
        action: SendOn,
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> Action:
        """Run the app once on `action`'s lease and tell the machine how it went."""
        attempt = _Attempt(send, machine)
        span = action.span
        try:
            if span is None:
                await self.inner(ctx, scope, _replay(ctx, receive), attempt.send)
            else:
                with tm.activate(span):  # the app's own call spans nest under it
                    await self.inner(ctx, scope, _replay(ctx, receive), attempt.send)
        except asyncio.CancelledError:
            # A response already sent whole still has its outcome (uvicorn reports a
            # disconnect once a response completes, and the base cancels then).
            machine.ended(_FINISHED if attempt.finished else _GONE, gone=_CANCELLED)
            raise
        except Exception as exc:
            if attempt.finished:
                machine.ended(_FINISHED)
                raise
            after = machine.ended(_RAISED, error=type(exc))
            if after is DONE:
                raise  # the response started, nobody waits, or the app is broken
            _log.warning("account %s failed (%s)", action.lease.account, type(exc).__name__)
            return after
        if attempt.held is not None and not attempt.complete:
            try:
                await attempt.flush()  # the app returned mid-body: pass on what it sent
            except BaseException:
                machine.ended(_GONE)  # the client is gone: the lease goes back, no outcome
                raise
        if attempt.held is not None and machine.state is State.READING:
            machine.read(_body_of(attempt.held))  # a 400: a context-length refusal?
        after = machine.ended(_FINISHED if attempt.finished else _RETURNED, held=attempt.held)
        if machine.failure is not None:  # the app's framework answered a transport error
            error = ctx.transport_error
            name = "" if error is None else error.__name__
            _log.warning("account %s failed (%s)", action.lease.account, name)
        return after


def _body_of(held: list[Message]) -> bytes:
    """The body of a held answer (bounded by MAX_HELD_BYTES)."""
    return b"".join(m.get("body", b"") for m in held if m["type"] == "http.response.body")


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
