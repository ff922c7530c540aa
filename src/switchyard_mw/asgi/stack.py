"""`switchyard_stack()`: the four policies around an app, built from one config."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import httpx

from ..clients import UpstreamClient, build_clients
from ..config import Config, load_config
from ..core.clock import Clock, monotonic
from ..core.pool import AccountPool
from ..state import Store, build_store
from ._types import ASGIApp, Receive, Scope, Send
from .cooling import CoolingMiddleware, pool_from_clients
from .deadline import DeadlineMiddleware
from .judge import JudgeMiddleware
from .variant import VariantMiddleware


class SwitchyardStack:
    """The app wrapped as Judge → Variant → Cooling → Deadline → app. An ASGI app itself.

    `pool` is the account pool (for an operator view); `store` shares its state as
    `[state]` says (built from the config unless given). The store connects on the first
    ASGI call (the lifespan startup under a server), waiting at most its timeout. `aclose()`
    closes the store and the judge's connection pool when the stack built it.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        config: Config,
        clients: Mapping[str, UpstreamClient],
        judge_http_client: httpx.AsyncClient | None = None,
        clock: Clock = monotonic,
        store: Store | None = None,
    ) -> None:
        self.config = config
        self.clients = dict(clients)
        self.pool: AccountPool = pool_from_clients(self.clients, clock=clock)
        self.store: Store = store if store is not None else build_store(config.state)
        self.store.bind(self.pool)
        self._store_started = False
        server = config.server
        inner: ASGIApp = DeadlineMiddleware(app, server=server)
        inner = CoolingMiddleware(inner, clients=self.clients, pool=self.pool, server=server)
        inner = VariantMiddleware(inner, canaries=config.canaries, server=server)
        self.judge = JudgeMiddleware(
            inner,
            routes=config.routes,
            clients=self.clients,
            http_client=judge_http_client,
            server=server,
        )
        self._app: ASGIApp = self.judge

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self._store_started:
            # The store needs the server's event loop, which the constructor may not have.
            self._store_started = True
            await self.store.start()
        await self._app(scope, receive, send)

    async def aclose(self) -> None:
        await self.store.aclose()
        await self.judge.aclose()


def switchyard_stack(
    app: ASGIApp,
    *,
    config: Config | str | os.PathLike[str],
    environ: Mapping[str, str] | None = None,
    judge_http_client: httpx.AsyncClient | None = None,
    clock: Clock = monotonic,
) -> SwitchyardStack:
    """Wrap `app` in all four policies.

    `config` is a loaded `Config` or a path to its TOML file; API keys are read from the
    environment (`environ`, default `os.environ`) now, so a missing one fails at start-up.
    With `[state] backend = "redis"` the account pool's state is shared through Redis.
    """
    if not isinstance(config, Config):
        config = load_config(Path(config))
    clients = build_clients(config, environ)
    return SwitchyardStack(
        app, config=config, clients=clients, judge_http_client=judge_http_client, clock=clock
    )
