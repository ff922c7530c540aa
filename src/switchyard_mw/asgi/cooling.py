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

from collections.abc import Mapping
from typing import Unpack

import msgspec

from ..accounts import Account
from ..config import Config, ConfigSource, Server, as_config
from ..context import RequestContext
from ..engine.answers import NO_HEALTHY_ACCOUNT, RATE_LIMITED, UPSTREAM_UNREACHABLE
from ..engine.attempts import APP_ERROR
from ..engine.build import Front, Parts, build_engine
from ..engine.policies import Engine
from ..engine.variants import Canaries
from ._base import PolicyMiddleware
from ._types import ASGIApp, Message, Receive, Scope, Send
from .admin import cooling_status_app as cooling_status_app  # re-exported for existing imports
from .attempt_driver import run_attempts
from .exchange import MAX_HELD_BYTES as MAX_HELD_BYTES
from .exchange import exchange_of

__all__ = [
    "APP_ERROR",
    "MAX_HELD_BYTES",
    "NO_HEALTHY_ACCOUNT",
    "RATE_LIMITED",
    "UPSTREAM_UNREACHABLE",
    "CoolingMiddleware",
    "cooling_status_app",
]


class CoolingMiddleware(PolicyMiddleware):
    """Chooses an account per attempt, cools faulty ones, fails over.

    Alone, build it from the config (a `Config` or the path of its TOML file), as any
    framework adds a middleware: `app.add_middleware(CoolingMiddleware, config="s.toml")`.
    The accounts are its `[llm_clients]` (keys read from `environ`, default `os.environ`, now),
    and `[state]` says where their health lives; a store it built connects on the first ASGI
    call and closes at lifespan shutdown or `aclose()`.

    `accounts` (instead of `config`) and `pool` share one pool between policies (its owner
    keeps it in step with `[state]`), and `engine` (instead of both) is how `SwitchyardStack`
    hands in its decisions; `clock` is the pool's. Requests for a model no account serves pass
    through untouched, as do requests that are not LLM calls.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        config: ConfigSource | None = None,
        environ: Mapping[str, str] | None = None,
        accounts: Mapping[str, Account] | None = None,
        server: Server | None = None,
        engine: Engine | None = None,
        **parts: Unpack[Parts],
    ) -> None:
        owned = engine is None
        if engine is None:
            engine = _engine(config, environ, accounts, server, **parts)
        super().__init__(app, server=server or engine.server)
        self.engine = engine
        self.accounts = engine.accounts
        self.pool = engine.pool
        self.store = engine.store if owned else None
        """The state store built with this middleware's engine (None: the stack's)."""
        if self.store is not None:
            self._start = self.store.start  # needs the server's event loop

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

    async def handle(self, ctx: RequestContext, scope: Scope, receive: Receive, send: Send) -> None:
        ex = exchange_of(scope)
        if ex is None or ctx.wire is None or ctx.resolved_model is None:
            return await self.app(scope, receive, send)
        # Without an SDK, no span at all: nothing to build, activate or end.
        machine = self.engine.machine(ctx, ex.traced, None, True)
        await run_attempts(ex, machine, self.app, scope)


def _engine(
    config: ConfigSource | None,
    environ: Mapping[str, str] | None,
    accounts: Mapping[str, Account] | None,
    server: Server | None,
    **parts: Unpack[Parts],
) -> Engine:
    """The cooling policy's own engine: from `config`, or from `accounts` alone (no chains)."""
    if config is not None:
        if accounts is not None:
            raise TypeError("CoolingMiddleware takes config or accounts, not both")
        loaded = as_config(config)
        if server is not None:
            loaded = msgspec.structs.replace(loaded, server=server)
        return build_engine(loaded, front=Front.COOLING, environ=environ, **parts)
    if accounts is None:
        raise TypeError("CoolingMiddleware needs config (or accounts)")
    return build_engine(Config(server=server or Server()), accounts, front=Front.COOLING, **parts)
