"""`switchyard_stack()`: the four policies around an app, built from one config."""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Awaitable, Mapping

import httpx

from ..accounts import Account, build_accounts
from ..config import Config, ConfigSource, as_config, load_config
from ..context import RequestContext
from ..core.clock import Clock, monotonic
from ..engine import reload
from ..engine.build import Front, Parts, build_engine
from ..engine.build import shared_budgets as shared_budgets  # its home before the builder
from ..engine.paths import llm_wire
from ..engine.policies import Engine
from ..engine.reload import Loader
from ..engine.tenancy import Admission, Refusal, billed
from ..state import LimitStore, Store
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
        self._signal = reload_on_signal and loader is not None
        self._retiring: dict[Shadows, asyncio.Task[None]] = {}
        parts: Parts = {"clock": clock, "judge_http_client": judge_http_client}
        if store is not None:
            parts["store"] = store
        if limit_store is not None:
            parts["limit_store"] = limit_store
        # The store needs the server's event loop, which the constructor may not have.
        self._start = self._startup
        self._build(build_engine(config, accounts, front=Front.ASGI, environ=environ, **parts))

    def _build(self, engine: Engine) -> None:
        """Put `engine` in force with its ASGI faces, all at once (no await in between)."""
        app, server = self.app, engine.server
        # One engine makes every decision; the policies are its ASGI faces (every attempt's
        # outcome feeds the variants' guards through it).
        deadline = DeadlineMiddleware(app, server=server)
        variant = VariantMiddleware(app, server=server, engine=engine)
        judge = JudgeMiddleware(app, server=server, engine=engine)
        cooling = CoolingMiddleware(app, engine=engine, server=server)
        config, store, limit_store = engine.config, engine.store, engine.limit_store
        # `build_engine` gives the ASGI front all three.
        assert config is not None
        assert store is not None
        assert limit_store is not None
        shadows = Shadows.build(
            config.canaries,
            accounts=engine.accounts,
            pool=engine.pool,
            max_inflight=server.shadow_max_inflight,
        )
        super().__init__(app, server=server)  # the paths and limits every request is read with
        self.config, self.accounts, self.pool, self.engine = (
            config,
            engine.accounts,
            engine.pool,
            engine,
        )
        self.store: Store = store
        self.limit_store: LimitStore = limit_store
        """Where the tenants' limits are counted; kept across reloads (what was spent stays
        spent)."""
        self.tenancy = engine.tenancy
        """Who may spend the keys and how much (None: no `[tenants]`, anyone who reaches the
        gateway spends them)."""
        self.deadline, self.cooling, self.variant, self.judge = deadline, cooling, variant, judge
        self.shadows = shadows
        """Mirrors a share of canaried models' requests (None: no canary has a shadow)."""

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
        engine = reload.rebuild(self.engine, loader, Front.ASGI, self.environ)
        if isinstance(engine, list):
            return engine
        old_shadows = self.shadows
        self._build(engine)
        if old_shadows is not None:
            self._retire(old_shadows)
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

    def handle(
        self, ctx: RequestContext, scope: Scope, receive: Receive, send: Send
    ) -> Awaitable[None]:
        """The policies in order, as a plain call handing back what to await: the usual
        request (no tenants, no judge route, its body read and its model known) goes straight
        to its attempts, without a coroutine of its own; any other takes `_handle`."""
        engine = self.engine
        judge = engine.judge
        if self.tenancy is not None or (judge is not None and judge.applies(ctx.view)):
            return self._handle(ctx, scope, receive, send)  # it may wait, or be refused
        ex = exchange_of(scope)
        if ex is None or ctx.view is None or ctx.resolved_model is None:
            return self._handle(ctx, scope, receive, send)  # the app as it is
        # `_handle`'s steps for it, with nothing to await on the way (a canary's choice is a
        # model too: the attempts follow).
        canaries = engine.canaries
        if canaries is not None:
            canaries.assign(ctx)
        shadows = self.shadows
        if shadows is not None:
            shadows.mirror(ctx, scope["path"])
        machine = engine.machine(ctx, ex.traced, None, True)
        return run_attempts(ex, machine, self.app, scope, limits=self.deadline)

    async def _handle(
        self, ctx: RequestContext, scope: Scope, receive: Receive, send: Send
    ) -> None:
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
        # The engine's judge and canaries asked directly: no call at all where none is
        # configured, and no coroutine for the many requests with no route.
        judge, canaries = engine.judge, engine.canaries
        if judge is not None and judge.applies(ctx.view):
            await engine.judge_model(ctx, gone=lambda: ctx.disconnected)
        if canaries is not None:
            canaries.assign(ctx)
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
        machine = engine.machine(ctx, ex.traced, None, True)
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
