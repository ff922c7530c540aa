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

from collections.abc import Callable, Collection, Mapping

from opentelemetry import trace

from ..accounts import Account
from ..config import Config, Server
from ..context import RequestContext
from ..core.clock import Clock, monotonic
from ..core.pool import AccountPool, Lease, Outcome
from ..state import LimitStore, Store
from ..telemetry import names as tm
from ..wire import Wire, WireError
from . import answers, attempts
from .fallbacks import Chains
from .hedging import Hedging
from .judge import Judge
from .machine import AttemptMachine
from .outcomes import hold, probed, settle
from .paths import llm_paths
from .tenancy import Tenancy
from .variants import Canaries

_SUCCESS, _FAULT, _THROTTLE = Outcome.SUCCESS, Outcome.FAULT, Outcome.THROTTLE


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
    ) -> None:
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
        self.accounts = dict(accounts)
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
        self._uncounting = frozenset(n for n, a in self.accounts.items() if not a.counts_tokens)
        # Read when an attempt's span starts: parsed once here, not per request.
        self._providers = {n: tm.provider_name(c.base_url) for n, c in self.accounts.items()}

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
        names = self.pool.accounts_for(model)
        routable = self.routable
        return names if routable is None else [n for n in names if n in routable]

    def cannot_count(self, model: str) -> frozenset[str]:
        """The accounts a token count for `model` skips: those of a kind that cannot count
        (Bedrock), when an account serving `model` that the front can send to can; none when
        none can, so that the count's account answers the wire's 404 itself."""
        uncounting = self._uncounting
        if not uncounting or all(n in uncounting for n in self.serving(model)):
            return frozenset()
        return uncounting

    def places(self, ctx: RequestContext) -> bool:
        """Whether the request is switchyard's to place: an account serves its model, or the
        canary's base model that may take over."""
        model = ctx.resolved_model
        return model is not None and (bool(self.serving(model)) or self.fallback(ctx) is not None)

    def fallback(self, ctx: RequestContext) -> str | None:
        """The canary's base model, if it may take over (`ctx.canary_base`) and is served."""
        base = ctx.canary_base()
        return base if base is not None and self.serving(base) else None

    def machine(
        self,
        ctx: RequestContext,
        *,
        traced: bool = False,
        parent: trace.Span | None = None,
        checks_errors: bool = False,
        clock: Clock = monotonic,
    ) -> AttemptMachine:
        """The attempt machine of one request whose model is decided (see `engine.machine`)."""
        return AttemptMachine(
            self, ctx, traced=traced, parent=parent, checks_errors=checks_errors, clock=clock
        )

    def nothing_serves(
        self, ctx: RequestContext, refused: Collection[str] = (), skipped: Collection[str] = ()
    ) -> tuple[WireError, answers.Headers]:
        """The answer when no account can take the request: 429 or 503, with `retry-after`
        for the soonest account that waiting heals. Accounts cooling for refused credentials
        count only when no other is left (then 503 says so, without a long `retry-after`), and
        so do the accounts that refused their key or billing in this request (`refused`).
        `skipped`: accounts that could never take it (a token count's `cannot_count`), whose
        health says nothing of when it can be served."""
        allowed = self.routable
        if refused or skipped:
            names = self.pool.names if allowed is None else allowed
            allowed = frozenset(n for n in names if n not in refused and n not in skipped)
        found = [
            self.pool.recovery(model, allowed=allowed)
            for model in (ctx.resolved_model, self.fallback(ctx))
            if model is not None
        ]
        heals = [r.heals_in_secs for r in found if r is not None and r.heals_in_secs is not None]
        cooling = [
            r.refused_in_secs for r in found if r is not None and r.refused_in_secs is not None
        ]
        model = ctx.resolved_model
        throttled = model is not None and self.pool.throttled(model)
        return answers.nothing_serves(
            model,
            throttled=throttled,
            heals_in_secs=min(heals, default=None),
            refused_in_secs=min(cooling, default=None),
            refused_now=bool(refused),
        )

    @staticmethod
    def plain_success(ctx: RequestContext, status: int) -> bool:
        """A success for sure: every fault and throttle is a 4xx/5xx, a deadline or a
        departure. Asked first, so that the usual answer costs no outcome at all."""
        return (
            status < 400
            and ctx.upstream_status is None
            and ctx.deadline_phase is None
            and not ctx.disconnected
        )

    # --- attempts -----------------------------------------------------------------------

    def start_attempt(self, ctx: RequestContext, lease: Lease) -> Account:
        """Make `lease`'s account the request's for its next attempt."""
        # Bound to the model: the body and path carry the account's own name for it.
        client = ctx.account = self.accounts[lease.account].for_model(ctx.resolved_model)
        ctx.attempts += 1
        return client

    def attempt_span(
        self, ctx: RequestContext, lease: Lease, parent: trace.Span | None = None
    ) -> trace.Span:
        """The attempt's span, under the current span or `parent` (the request's)."""
        context = None if parent is None else trace.set_span_in_context(parent)
        provider = self._providers.get(lease.account)
        return attempts.start_span(lease, ctx.resolved_model, provider, context)

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
        """Give the lease back with what the attempt said about the account's health (None:
        nothing); the canary guards count it, the span shows it, and a 429's retry-time
        headers (`retry`) hold its account out for the model."""
        canaries = self.canaries
        if canaries is not None and outcome is not None and model is not None:
            canaries.record(model, fault=outcome is _FAULT)
        if span is not None:
            attempts.mark_span(span, outcome, status)
        settle(self.pool, lease, outcome, status)
        if outcome is _THROTTLE and retry and model is not None:
            hold(self.pool, lease.account, model, retry)

    def succeeded(self, lease: Lease, model: str | None) -> None:
        """`settle` for the usual attempt, a success with no span: nothing to count or show."""
        self.pool.record(lease, _SUCCESS)
        if lease.probe:
            probed(self.pool, lease, _SUCCESS, "200")
        if self.canaries is not None and model is not None:
            self.canaries.record(model, fault=False)


async def judge_model(judge: Judge, ctx: RequestContext, gone: Callable[[], bool]) -> None:
    """`judge`'s choice of model and route header for a request whose model names one of its
    routes; nothing for any other. `gone`: whether the caller left (the wait is cancelled)."""
    view = ctx.view
    if view is None or not judge.applies(view):
        return
    decision = await judge.decide(view.model, view, ctx.body or b"", ctx.budget_at, gone=gone)
    ctx.resolved_model, ctx.route = decision.model, decision.route_header
