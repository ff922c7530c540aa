"""`switchyard_stack()`: the four policies around an app, built from one config."""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Mapping

import httpx

from ..accounts import Account, build_accounts, pool_from_accounts
from ..config import Config, ConfigSource, as_config, load_config
from ..context import RequestContext
from ..core.clock import Clock, monotonic
from ..core.pool import AccountPool
from ..engine import reload
from ..engine.fallbacks import Chains
from ..engine.hedging import BUCKETS, WINDOW_SECS, Hedging, SharedBudgets
from ..engine.machine import AttemptMachine
from ..engine.paths import llm_wire
from ..engine.policies import Engine
from ..engine.reload import Loader
from ..engine.tenancy import Admission, Refusal, Tenancy, billed
from ..state import LimitStore, Store, build_limits, build_store
from ..telemetry import names as tm
from ..telemetry import request_metrics
from ._base import PolicyMiddleware
from ._types import ASGIApp, Message, Receive, Scope, Send
from .attempt_driver import run_attempts, run_timed
from .cooling import CoolingMiddleware
from .deadline import DeadlineMiddleware
from .exchange import exchange_of
from .judge_middleware import JudgeMiddleware
from .shadow import Shadows
from .tenants import identified, refuse, settled, unread_identified
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

    `reload()` puts a new config in force without a restart (see there); every attribute
    above then names the new policies, so read them when needed rather than keeping them.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        config: Config,
        accounts: Mapping[str, Account],
        judge_http_client: httpx.AsyncClient | None = None,
        clock: Clock = monotonic,
        store: Store | None = None,
        limit_store: LimitStore | None = None,
        loader: Loader | None = None,
        environ: Mapping[str, str] | None = None,
        reload_on_signal: bool = True,
    ) -> None:
        super().__init__(app, server=config.server)
        self.clock = clock
        self.loader = loader
        """Where `reload()` gets the config again (None: only a `Config` handed to it)."""
        self.environ = environ
        self._judge_http = judge_http_client
        self._signal = reload_on_signal and loader is not None
        self._retiring: dict[Shadows, asyncio.Task[None]] = {}
        self.store: Store = store if store is not None else build_store(config.state)
        self.limit_store: LimitStore = (
            limit_store if limit_store is not None else build_limits(config.state)
        )
        """Where the tenants' limits are counted; kept across reloads (what was spent stays
        spent)."""
        # The store needs the server's event loop, which the constructor may not have.
        self._start = self._startup
        self._build(config, dict(accounts), pool_from_accounts(accounts, clock=clock))

    def _build(self, config: Config, accounts: dict[str, Account], pool: AccountPool) -> None:
        """Put the policies of `config` in force, all at once (no await in between)."""
        app, server = self.app, config.server
        previous: JudgeMiddleware | None = getattr(self, "judge", None)
        deadline = DeadlineMiddleware(app, server=server)
        variant = VariantMiddleware(app, canaries=config.canaries, server=server, clock=self.clock)
        self.store.share_trips(variant.canaries)  # with Redis, a trip holds everywhere
        judge = JudgeMiddleware(
            app,
            routes=config.routes,
            accounts=accounts,
            http_client=self._judge_http,
            server=server,
        )
        if previous is not None:
            judge.judge.take_over(previous.judge)
        # One engine makes every decision; the policies are its ASGI faces (every attempt's
        # outcome feeds the variants' guards through it).
        engine = Engine(
            server=server,
            accounts=accounts,
            pool=pool,
            judge=judge.judge,
            canaries=variant.canaries,
            chains=Chains(config.fallbacks),
        )
        if any(a.spec.hedge_after_secs is not None for a in accounts.values()):
            engine.hedging = Hedging(
                accounts=accounts,
                max_ratio=server.hedge_max_ratio,
                clock=self.clock,
                shared=shared_budgets(self.store, server.hedge_max_ratio),
                timeout_secs=config.state.timeout_ms / 1000,
            )
        cooling = CoolingMiddleware(app, engine=engine, server=server)
        shadows = Shadows.build(
            config.canaries, accounts=accounts, pool=pool, max_inflight=server.shadow_max_inflight
        )
        self.store.bind(pool)
        super().__init__(app, server=server)  # the paths and limits every request is read with
        self.config, self.accounts, self.pool, self.engine = config, accounts, pool, engine
        self.deadline, self.cooling, self.variant, self.judge = deadline, cooling, variant, judge
        self.shadows = shadows
        """Mirrors a share of canaried models' requests (None: no canary has a shadow)."""
        self.tenancy = Tenancy.build(config, store=self.limit_store, environ=self.environ)
        """Who may spend the keys and how much (None: no `[tenants]`, anyone who reaches the
        gateway spends them)."""

    def reload(self, config: Config | None = None) -> list[str]:
        """Put a new config in force: `config`, else the one `loader` reads now.

        Keys are read again from `environ` (default: this process's environment). Requests
        under way finish with the policies they started with; account health is kept for
        every account whose name and `base_url` did not change; the canary guards start
        afresh. Returns the problems that refused it (logged, the old config staying in
        force), an empty list when it took effect. A SIGHUP calls it once the stack serves
        (when it has a `loader`).
        """
        loader = self.loader if config is None else (lambda: config)
        if loader is None:
            return reload.rejected(["no config to reload from: the stack was given a Config"])
        prepared = reload.prepare(loader, self.config, self.environ)
        if isinstance(prepared, list):
            return prepared
        new_config, accounts = prepared
        old_pool = self.pool
        pool = pool_from_accounts(accounts, clock=self.clock)
        pool.carry_over(old_pool, accounts=reload.kept_accounts(self.accounts, accounts))
        old_shadows = self.shadows
        self._build(new_config, accounts, pool)
        request_metrics.unwatch(old_pool)
        if old_shadows is not None:
            self._retire(old_shadows)
        reload.accepted("")
        return []

    def _retire(self, shadows: Shadows) -> None:
        """Close a replaced config's shadows once their mirrors in flight have ended."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # reloaded outside any loop: no mirror can be in flight
        task = self._retiring[shadows] = loop.create_task(shadows.retire())
        task.add_done_callback(lambda _: self._retiring.pop(shadows, None))

    def _on_signal(self) -> None:
        self.reload()

    async def _startup(self) -> None:
        await self.store.start()
        starting = getattr(self.limit_store, "start", None)  # a Redis one connects first
        if starting is not None:
            await starting()
        if self._signal:
            reload.on_signal(self._on_signal)

    async def other(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            return await self.app(scope, receive, send)

        # The judge's pool closes just before shutdown completes: the judge in force then,
        # which a reload may have replaced since startup (it took the pool over).
        async def send_closing(message: Message) -> None:
            if message["type"] == "lifespan.shutdown.complete":
                await self.judge.aclose()
            await send(message)

        await self.app(scope, receive, send_closing)

    async def handle(self, ctx: RequestContext, scope: Scope, receive: Receive, send: Send) -> None:
        # The policies in force now: a reload during this request leaves it on these.
        engine, shadows, tenancy = self.engine, self.shadows, self.tenancy
        ex = exchange_of(scope)
        # Who is asking, before anything is spent on the request (the judge included).
        if tenancy is not None:
            view = ctx.view
            wire = (
                view.wire
                if view is not None
                else llm_wire(self._paths, scope.get("method", ""), self._path_of(scope))
            )
            if wire is not None:
                if view is not None:  # read: its exchange exists
                    refusal = identified(tenancy, ctx, scope)
                else:
                    # An LLM path whose body switchyard does not read (not JSON): no model to
                    # check or limit to count, but only a known tenant reaches the app.
                    refusal = unread_identified(tenancy, ctx, scope)
                if refusal is not None:
                    return await refuse(send if ex is None else ex.out, wire, refusal)
        if engine.judged(ctx):  # no coroutine for the many requests with no route
            await engine.judge_model(ctx, gone=lambda: ctx.disconnected)
        engine.assign_variant(ctx)
        admission: Admission | None = None
        if (
            ctx.tenant is not None
            and tenancy is not None
            and ctx.view is not None
            and billed(scope["path"])
        ):
            outcome = await tenancy.admit_request(ctx)
            if isinstance(outcome, Refusal):
                assert ex is not None
                return await refuse(ex.out, ctx.view.wire, outcome)
            admission = outcome
        if shadows is not None:
            shadows.mirror(ctx, scope["path"])
        if ex is None:  # not an LLM call switchyard read
            return await self.app(scope, receive, send)
        if ctx.view is None or ctx.resolved_model is None:
            return await run_timed(ex, self.app, scope, self.deadline)
        # Without an SDK, no span at all: nothing to build, activate or end.
        machine = AttemptMachine(engine, ctx, tm.tracing(), None, True)
        run = run_attempts(ex, machine, self.app, scope, limits=self.deadline)
        if admission is None:
            await run
        else:
            assert tenancy is not None
            await settled(tenancy, admission, ctx, run)

    async def aclose(self) -> None:
        """Release what the stack holds: its SIGHUP handler, the shadows' HTTP clients, the state
        store's connections and the judge's connection pool (when the stack built it). Call it
        once, at the server's lifespan shutdown."""
        if self._signal:
            reload.off_signal()
        for shadows, task in list(self._retiring.items()):
            task.cancel()
            await shadows.aclose()
        if self.shadows is not None:
            await self.shadows.aclose()
        await self.store.aclose()
        closing = getattr(self.limit_store, "aclose", None)  # a Redis one holds connections
        if closing is not None:
            await closing()
        await self.judge.aclose()


def shared_budgets(store: Store, max_ratio: float) -> SharedBudgets | None:
    """Each model's hedge budget in the state store, where it keeps one (Redis)."""
    budget = getattr(store, "hedge_budget", None)
    if budget is None:
        return None
    return functools.partial(budget, max_ratio=max_ratio, window_secs=WINDOW_SECS, buckets=BUCKETS)


def switchyard_stack(
    app: ASGIApp,
    *,
    config: ConfigSource,
    environ: Mapping[str, str] | None = None,
    judge_http_client: httpx.AsyncClient | None = None,
    clock: Clock = monotonic,
    reload_from: str | os.PathLike[str] | Loader | None = None,
    reload_on_signal: bool = True,
) -> SwitchyardStack:
    """Wrap `app` in all four policies.

    `config` is a loaded `Config` or a path to its TOML file; API keys are read from the
    environment (`environ`, default `os.environ`) now, so a missing one fails at start-up.
    With `[state] backend = "redis"` the account pool's state is shared through Redis.

    `stack.reload()` puts the config in force again as `reload_from` gives it (a path, or a
    function returning a `Config`; default: the path `config` names, if it is one); with
    `reload_on_signal`, a SIGHUP to the process does the same once the stack serves.
    """
    loader: Loader | None = None
    if reload_from is not None:
        loader = (
            reload_from if callable(reload_from) else functools.partial(load_config, reload_from)
        )
    if not isinstance(config, Config):
        loader = loader or functools.partial(load_config, config)
    config = as_config(config)
    accounts = build_accounts(config, environ)
    return SwitchyardStack(
        app,
        config=config,
        accounts=accounts,
        judge_http_client=judge_http_client,
        clock=clock,
        loader=loader,
        environ=environ,
        reload_on_signal=reload_on_signal,
    )
