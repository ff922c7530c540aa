"""One config turned into one `Engine`: the only place the engine's parts are put together.

Each front asks for the engine it serves with (`Front`) and holds what comes back: the ASGI
stack, the cooling middleware alone, the ext_proc server. A reload builds the next engine here
too (`engine.reload.rebuild`), handing in what outlives a config: the state stores, the pool
its health carried over into, the judge's connection pool. What the builder makes, in order:

- the accounts (keys read from the environment now, unless handed in) and their pool, watched
  by `switchyard.account.state`;
- the `[state]` store, bound to the pool (kept across reloads: connected once per process);
- the judge of `[routes]` and the canaries of `[canaries]`, whose guard trips the store shares;
- the `[fallbacks]` chains;
- the hedging of accounts with `hedge_after_secs` (only where the front races: ASGI);
- the tenants' limit store and tenancy (kept across reloads: what was spent stays spent).

It runs when a config is loaded or reloaded, never per request.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Mapping
from typing import TypedDict, Unpack

import httpx

from ..accounts import Account, build_accounts, pool_from_accounts
from ..config import Config
from ..core.clock import Clock, monotonic
from ..core.pool import AccountPool
from ..state import LimitStore, MemoryStore, Store, build_limits, build_store
from ..telemetry import request_metrics
from .fallbacks import Chains
from .hedging import BUCKETS, WINDOW_SECS, Hedging, SharedBudgets
from .judge import Judge
from .policies import Engine
from .tenancy import Tenancy
from .variants import Canaries


class Front(enum.Enum):
    """Which front the engine serves: it decides which parts are built."""

    ASGI = "asgi"
    """The stack: every policy, hedged first tokens raced on any account."""
    ENVOY = "envoy"
    """The ext_proc server: every policy (hedging only with `[server] envoy_hedge`, when
    Envoy's route hedges), on the accounts with an `envoy_cluster` only; a retry's body is the
    processor's to rewrite when accounts rename models or fallback chains move requests."""
    COOLING = "cooling"
    """The cooling middleware alone: accounts, pool, store and chains, no judge, canaries or
    tenants (other middlewares hold those). A pool handed in is shared with the policy that
    built it, which keeps it in step: it gets no `[state]` store of its own."""


class Parts(TypedDict, total=False):
    """What a caller may hand the builder instead of its building it: a pool shared between
    policies (or a test's counting one), the stores a reload keeps, a test's clock, the judge's
    connection pool (whoever passes it closes it)."""

    pool: AccountPool
    store: Store
    limit_store: LimitStore
    clock: Clock
    judge_http_client: httpx.AsyncClient | None


def build_engine(
    config: Config,
    accounts: Mapping[str, Account] | None = None,
    *,
    front: Front,
    environ: Mapping[str, str] | None = None,
    **parts: Unpack[Parts],
) -> Engine:
    """The engine of `config` for `front`; `accounts` are built from `config` (keys read from
    `environ`, default this process's environment) unless given. `StartupError` when a key or
    a store's client library is missing."""
    clock = parts.get("clock", monotonic)
    accounts = dict(build_accounts(config, environ) if accounts is None else accounts)
    pool = parts.get("pool")
    shared = pool is not None and front is Front.COOLING
    if pool is None:
        pool = pool_from_accounts(accounts, clock=clock)
    request_metrics.watch(pool)  # `switchyard.account.state`
    store = parts.get("store")
    if store is None:
        store = MemoryStore() if shared else build_store(config.state)
    store.bind(pool)
    engine = Engine(
        server=config.server,
        accounts=accounts,
        pool=pool,
        chains=Chains(config.fallbacks),
        config=config,
        store=store,
    )
    if front is Front.COOLING:
        return engine
    engine.judge = Judge(
        routes=config.routes, accounts=accounts, http_client=parts.get("judge_http_client")
    )
    engine.canaries = Canaries.from_config(config.canaries, clock=clock)
    store.share_trips(engine.canaries)  # with Redis, a trip holds everywhere
    limit_store = parts.get("limit_store")
    engine.limit_store = limit_store if limit_store is not None else build_limits(config.state)
    engine.tenancy = Tenancy.build(config, store=engine.limit_store, environ=environ)
    if front is Front.ENVOY:
        _for_envoy(engine)
    hedges = front is not Front.ENVOY or config.server.envoy_hedge  # Envoy's route hedges
    if hedges and any(a.spec.hedge_after_secs is not None for a in accounts.values()):
        engine.hedging = Hedging(
            accounts=accounts,
            max_ratio=config.server.hedge_max_ratio,
            clock=clock,
            shared=shared_budgets(store, config.server.hedge_max_ratio),
            timeout_secs=config.state.timeout_ms / 1000,
        )
    return engine


def _for_envoy(engine: Engine) -> None:
    # Only accounts Envoy can route to take requests: the others have no cluster to name.
    engine.routable = frozenset(n for n, a in engine.accounts.items() if a.spec.envoy_cluster)
    # A fallback chain moves a retry to another model: its body is then ours to set too.
    renames = any(a.renames for a in engine.accounts.values())
    engine.rewrites_retries = renames or bool(engine.chains)


def shared_budgets(store: Store, max_ratio: float) -> SharedBudgets | None:
    """Each model's hedge budget in the state store, where it keeps one (Redis)."""
    budget = getattr(store, "hedge_budget", None)
    if budget is None:
        return None
    return functools.partial(budget, max_ratio=max_ratio, window_secs=WINDOW_SECS, buckets=BUCKETS)
