"""`switchyard_stack()`: the four policies around an app, built from one config."""

from __future__ import annotations

from collections.abc import Mapping

import httpx

from ..clients import UpstreamClient, build_clients
from ..config import Config, ConfigSource, as_config
from ..context import RequestContext
from ..core.clock import Clock, monotonic
from ..core.pool import AccountPool
from ..shadow import Shadows
from ..state import Store, build_store
from ._base import PolicyMiddleware
from ._types import ASGIApp, Receive, Scope, Send
from .cooling import CoolingMiddleware, pool_from_clients
from .deadline import DeadlineMiddleware
from .judge import JudgeMiddleware
from .variant import VariantMiddleware


class SwitchyardStack(PolicyMiddleware):
    """The app wrapped as Judge → Variant → Cooling → Deadline → app. An ASGI app itself.

    One layer, not four: the request is read once and each policy's step runs in that order
    as a plain call, so the stack costs about what its work costs. `judge`, `variant`,
    `cooling` and `deadline` are the policies (each also usable as a middleware alone).

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
        server = config.server
        super().__init__(app, server=server)
        self.config = config
        self.clients = dict(clients)
        self.pool: AccountPool = pool_from_clients(self.clients, clock=clock)
        self.store: Store = store if store is not None else build_store(config.state)
        self.store.bind(self.pool)
        # The store needs the server's event loop, which the constructor may not have.
        self._start = self.store.start
        self.deadline = DeadlineMiddleware(app, server=server)
        self.cooling = CoolingMiddleware(app, clients=self.clients, pool=self.pool, server=server)
        self.cooling.inner = self.deadline.handle
        self.variant = VariantMiddleware(app, canaries=config.canaries, server=server, clock=clock)
        self.cooling.guard = self.variant.canaries  # every attempt's outcome feeds the guards
        self.store.share_trips(self.variant.canaries)  # with Redis, a trip holds everywhere
        self.shadows = Shadows.build(
            config.canaries,
            clients=self.clients,
            pool=self.pool,
            max_inflight=server.shadow_max_inflight,
        )
        """Mirrors a share of canaried models' requests (None: no canary has a shadow)."""
        self.judge = JudgeMiddleware(
            app,
            routes=config.routes,
            clients=self.clients,
            http_client=judge_http_client,
            server=server,
        )

    async def other(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.judge.other(scope, receive, send)  # it closes its pool at lifespan shutdown

    async def handle(self, ctx: RequestContext, scope: Scope, receive: Receive, send: Send) -> None:
        if self.judge.applies(ctx):  # no coroutine for the many requests with no route
            await self.judge.route(ctx)
        self.variant.assign(ctx)
        if self.shadows is not None:
            self.shadows.mirror(ctx, scope["path"])
        await self.cooling.handle(ctx, scope, receive, send)

    async def aclose(self) -> None:
        if self.shadows is not None:
            await self.shadows.aclose()
        await self.store.aclose()
        await self.judge.aclose()


def switchyard_stack(
    app: ASGIApp,
    *,
    config: ConfigSource,
    environ: Mapping[str, str] | None = None,
    judge_http_client: httpx.AsyncClient | None = None,
    clock: Clock = monotonic,
) -> SwitchyardStack:
    """Wrap `app` in all four policies.

    `config` is a loaded `Config` or a path to its TOML file; API keys are read from the
    environment (`environ`, default `os.environ`) now, so a missing one fails at start-up.
    With `[state] backend = "redis"` the account pool's state is shared through Redis.
    """
    config = as_config(config)
    clients = build_clients(config, environ)
    return SwitchyardStack(
        app, config=config, clients=clients, judge_http_client=judge_http_client, clock=clock
    )
