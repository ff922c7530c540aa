"""`Engine`: every per-request decision both fronts make, over one config's accounts.

The ASGI stack and the ext_proc servicer each hold one and translate their protocol to its
calls: which requests are LLM calls, the judge's model and the variant, what an attempt's end
means for its account, and what to answer when no account can serve. A request's attempts are
decided by its `AttemptMachine` (`engine.machine`), built here per request. What differs
between the fronts comes in as plain facts: the accounts a front can send to (`routable`:
behind Envoy, those with a cluster) and, for a retry, the accounts it may change to (the
machine's `within`: Envoy's cluster).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping

from opentelemetry import trace

from ..accounts import Account
from ..config import Config, Server
from ..context import RequestContext
from ..core.clock import Clock, monotonic
from ..core.pool import AccountPool, Lease, Outcome
from ..state import LimitStore, Store
from ..wire import Wire, WireError
from . import answers
from .fallbacks import Chains
from .grounds import Grounds
from .hedging import Hedging
from .judge import Judge
from .machine import AttemptMachine
from .paths import llm_paths
from .recorder import Recorder
from .tenancy import Tenancy
from .variants import Canaries

_GROUNDED = frozenset({"canaries", "chains", "routable", "rewrites_retries", "hedging"})
"""Engine attributes its machines read from its `grounds`: an assignment goes there too."""


class Engine:
    """The decisions of one config; a reload builds another (requests keep theirs).

    `judge` and `canaries` are None where nothing routes or splits (a cooling policy alone);
    `routable`: the accounts the front can send a request to (None: all of them);
    `chains`: the config's fallback chains (None: none). `engine.build` assembles one from a
    config (with the `config` itself, its `store` and, where tenants are, its `limit_store` and
    `tenancy`), which a front then holds.
    """

    def __init__(
        self,
        *,
        server: Server,
        accounts: Mapping[str, Account],
        pool: AccountPool,
        judge: Judge | None = None,
        canaries: Canaries | None = None,
        routable: frozenset[str] | None = None,
        chains: Chains | None = None,
        config: Config | None = None,
        store: Store | None = None,
        clock: Clock = monotonic,
    ) -> None:
        self.grounds = Grounds(
            server=server,
            accounts=dict(accounts),
            pool=pool,
            canaries=canaries,
            routable=routable,
            chains=chains,
            clock=clock,
        )
        """What the engine's attempt machines decide with (built once, shared by all)."""
        self.config = config
        """The config this engine decides by (None: built from parts, not a config)."""
        self.store = store
        """Where the pool's state is shared (`[state]`); kept across reloads."""
        self.limit_store: LimitStore | None = None
        """Where the tenants' limits are counted; kept across reloads (what was spent stays
        spent). None: the front counts no limits (the cooling policy alone)."""
        self.tenancy: Tenancy | None = None
        """Who may spend the keys and how much (None: no `[tenants]`)."""
        self.server = server
        self.accounts = self.grounds.accounts
        self.pool = pool
        self.judge = judge
        self.canaries = canaries
        self.routable = routable
        self.chains = chains if chains else None
        self.rewrites_retries = False
        """Whether the front rewrites the body of a retry it makes on its own (Envoy's): only
        then may a fallback chain move a request once the front committed to a cluster."""
        self.hedging: Hedging | None = None
        """Hedged first tokens (None: no account hedges, or the front does not race)."""
        self.paths: dict[str, Wire] = llm_paths(server)
        """The wire of each LLM path; any other path passes through unread."""
        self.machine = functools.partial(AttemptMachine, self.grounds)
        """The attempt machine of one request whose model is decided: `machine(ctx, traced,
        parent, checks_errors)` (see `engine.machine`). The one place a machine is built;
        positional, for the ASGI front (a call with keywords builds a dict of them first)."""

    def __setattr__(self, name: str, value: object) -> None:
        # Read as plain attributes (no call on a request's path), kept where the machines
        # read them: a front may set one after building the engine (a cooling policy's
        # canaries, Envoy's retry rewriting, the stack's hedging).
        object.__setattr__(self, name, value)
        if name in _GROUNDED:
            setattr(self.grounds, name, value)

    # --- route and model ----------------------------------------------------------------

    def judged(self, ctx: RequestContext) -> bool:
        """Whether the request's model names a route: only then is there a choice to make."""
        return self.judge is not None and self.judge.applies(ctx.view)

    async def judge_model(self, ctx: RequestContext, gone: Callable[[], bool]) -> None:
        """The judge's choice of model for a request it is `judged` for (else nothing)."""
        if self.judge is not None:
            await judge_model(self.judge, ctx, gone)

    def assign_variant(self, ctx: RequestContext) -> None:
        """Move the request to its variant when its model has a canary."""
        if self.canaries is not None:
            self.canaries.assign(ctx)

    async def decide_model(self, ctx: RequestContext, gone: Callable[[], bool]) -> None:
        """Judge (for a route), then variants: `ctx.resolved_model` and `ctx.route`."""
        if self.judged(ctx):
            await self.judge_model(ctx, gone)
        self.assign_variant(ctx)

    # --- accounts -----------------------------------------------------------------------

    def serving(self, model: str) -> Collection[str]:
        """The accounts serving `model` that the front can send to."""
        return self.grounds.serving(model)

    def nothing_serves(
        self, ctx: RequestContext, refused: Collection[str] = (), skipped: Collection[str] = ()
    ) -> tuple[WireError, answers.Headers]:
        """The answer when no account can take the request (`Grounds.nothing_serves`)."""
        return self.grounds.nothing_serves(ctx, refused, skipped)

    # --- attempts -----------------------------------------------------------------------

    def settle(
        self,
        lease: Lease,
        outcome: Outcome | None,
        status: str,
        model: str | None,
        *,
        span: trace.Span | None = None,
        retry: list[tuple[str, str]] | None = None,
    ) -> None:
        """Give the lease back with what the attempt said about the account's health
        (`Grounds.settle`); `span` shows it."""
        if span is not None:
            Recorder.settled(span, outcome, status)
        self.grounds.settle(lease, outcome, status, model, retry)


async def judge_model(judge: Judge, ctx: RequestContext, gone: Callable[[], bool]) -> None:
    """`judge`'s choice of model and route header for a request whose model names one of its
    routes; nothing for any other. `gone`: whether the caller left (the wait is cancelled)."""
    view = ctx.view
    if view is None or not judge.applies(view):
        return
    decision = await judge.decide(view.model, view, ctx.body or b"", ctx.budget_at, gone=gone)
    ctx.resolved_model, ctx.route = decision.model, decision.route_header
