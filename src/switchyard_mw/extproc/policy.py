"""The four policies as the ext_proc servicer applies them, built from one config.

Every decision is the engine's (`engine.policies.Engine`), the one the ASGI stack holds too;
what is Envoy-specific here is only which accounts can take a request (those with an
`envoy_cluster`, and within one request, those on the cluster Envoy was routed to) and how the
decisions travel: header options, Envoy's timeout headers, spans under Envoy's trace.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Collection, Mapping
from typing import NamedTuple, Protocol, Unpack

from opentelemetry import trace

from .._protos.envoy.config.core.v3 import base_pb2
from ..accounts import Account
from ..config import Config, LLMClient
from ..context import RequestContext
from ..engine.attempts import deadline_secs, start_secs
from ..engine.budget import budget_end
from ..engine.build import Front, Parts, build_engine
from ..engine.endpoints import Endpoints
from ..engine.fallbacks import Reason
from ..engine.judge import Judge
from ..engine.machine import AttemptMachine
from ..engine.paths import json_media, llm_wire
from ..engine.policies import Engine
from ..engine.variants import Canaries
from ..state import LimitStore, Store
from ..wire import RequestView, Wire
from . import _messages as msg
from .failover import Aggregates

_log = logging.getLogger(__name__)
CLUSTER_HEADER = "x-switchyard-cluster"
TIMEOUT_HEADER = "x-envoy-upstream-rq-timeout-ms"
PER_TRY_TIMEOUT_HEADER = "x-envoy-upstream-rq-per-try-timeout-ms"
HEDGE_HEADER = "x-switchyard-hedge"
"""Set on a request Envoy may hedge: it picks the route with the `hedge_policy`."""
_MAX_TIMEOUTS = 1024
"""Timeout headers kept by bounds (a whole answer's deadline grows with its output cap)."""


def _ms(secs: float) -> bytes:
    return str(max(1, math.ceil(secs * 1000))).encode()


class Started(Protocol):
    """A request whose attempts are about to be decided (an `extproc.flights.Flight`: named by
    what is read of it, as the flights hold policies and not the other way round)."""

    @property
    def ctx(self) -> RequestContext: ...

    @property
    def span(self) -> trace.Span | None: ...


class Policies:
    """One config's `engine` (judge, variants, account pool, deadlines) for requests arriving
    through Envoy, with what Envoy needs besides: the accounts it can route to, each one's
    header options, a request's timeout headers and the cluster a retry stays on."""

    def __init__(
        self,
        config: Config,
        accounts: Mapping[str, Account],
        *,
        environ: Mapping[str, str] | None = None,
        **parts: Unpack[Parts],
    ) -> None:
        # `environ`: where the tenants' keys are read (default this process's environment),
        # as a reload reads them.
        self._hold(build_engine(config, accounts, front=Front.ENVOY, environ=environ, **parts))

    @classmethod
    def of(cls, engine: Engine) -> Policies:
        """The policies around an engine built for Envoy (a reloaded config's)."""
        policies = cls.__new__(cls)
        policies._hold(engine)
        return policies

    def _hold(self, engine: Engine) -> None:
        # `build_engine` gives the Envoy front its config, stores and judge.
        config, store, limit_store, judge = (
            engine.config,
            engine.store,
            engine.limit_store,
            engine.judge,
        )
        assert config is not None
        assert store is not None
        assert limit_store is not None
        assert judge is not None
        assert engine.canaries is not None
        assert engine.routable is not None
        self.engine = engine
        self.config, self.server = config, engine.server
        self.accounts, self.pool = engine.accounts, engine.pool
        # `[state]`: with Redis, processors (and ASGI replicas) share one cooling state.
        self.store: Store = store
        self.judge: Judge = judge
        self.canaries: Canaries = engine.canaries
        self.routable: frozenset[str] = engine.routable
        if shadowed := sorted(m for m, c in config.canaries.items() if c.shadow):
            # Envoy sends each request once, to one cluster: a copy is not ours to make.
            _log.warning(
                "the ext_proc server ignores `shadow` (canaries %s): shadow traffic is ASGI only",
                ", ".join(shadowed),
            )
        self.paths: dict[str, Wire] = self.engine.paths
        self.endpoints = Endpoints(config)
        """The answers to `/v1/models` and any other `/v1/` path that is no LLM call."""
        # A retry stays on the cluster Envoy routed the request to.
        self.on_cluster: dict[str, frozenset[str]] = {}
        for name in self.routable:
            cluster = self.cluster_of(name)
            self.on_cluster[cluster] = self.on_cluster.get(cluster, frozenset()) | {name}
        # Built at load: what every request routed to an account sets (its key, its cluster).
        self.auth_options = {
            name: [msg.option(k, v.encode()) for k, v in self.accounts[name].auth_headers()]
            for name in self.routable
        }
        self.route_options = {
            name: [msg.option(CLUSTER_HEADER, self.cluster_of(name).encode()), *options]
            for name, options in self.auth_options.items()
        }
        # A request on the first cluster of an aggregate may be routed to the aggregate, whose
        # retries move across providers (`failover`, `order`).
        self.aggregates = Aggregates(self.server.envoy_failover)
        self.across_options = {
            name: [msg.option(CLUSTER_HEADER, self.aggregates.route(cluster).encode()), *options]
            for name, options in self.auth_options.items()
            if self.aggregates.route(cluster := self.cluster_of(name)) != cluster
        }
        self._orders: dict[tuple[str, str], Reach] = {}
        """By (cluster, model): the clusters a request goes to, and the accounts its tries may
        go to there (`reach`)."""
        self._timeouts: dict[tuple[float, float, bool], list[tuple[str, bytes]]] = {}
        """`deadline_headers` of requests without a budget, by their bounds."""
        renames = any(a.renames for a in self.accounts.values())
        self.renaming = engine.rewrites_retries
        """Whether some account has its own model names or path: a retry's body and `:path`
        are then the processor's to set (the upstream-level filter asks for the body)."""
        self.plain_answers = renames
        """Whether some account may answer in its own model name: its answer's `model` is then
        rewritten (`answer_names`), which takes uncompressed bytes, so the upstream is
        asked for `accept-encoding: identity`."""
        self.judged = engine.judged
        """Whether a request's model names a judged route: its `decide_model` then waits."""
        self.assign_variant = engine.assign_variant
        """`decide_model` of a request no judge decides: its variant, in the same call."""
        self.options = msg.Options()
        """Header options that repeat across requests (deadlines, exposed decisions)."""
        self.limit_store: LimitStore = limit_store
        self.tenancy = engine.tenancy
        """Who may spend the keys (None: no `[tenants]`); the same decisions as the ASGI
        stack's, the client key read from the request headers Envoy sends."""
        self.identity_headers: frozenset[str] = frozenset()
        """The request headers a tenant is named by, read beside the router's own."""
        if self.tenancy is not None:
            header = self.tenancy.tenant_header
            self.identity_headers = frozenset(
                ["x-api-key", "authorization", *([header] if header else [])]
            )

    def cluster_of(self, account: str) -> str:
        return self.accounts[account].spec.envoy_cluster or ""

    async def start(self) -> None:
        """Connect the shared state stores (the account-health one waiting at most its
        timeout, the limit store its start-up time)."""
        await self.store.start()
        starting = getattr(self.limit_store, "start", None)
        if starting is not None:
            await starting()

    async def aclose(self) -> None:
        await self.store.aclose()
        closing = getattr(self.limit_store, "aclose", None)  # a Redis one holds connections
        if closing is not None:
            await closing()
        await self.judge.aclose()

    def wire_of(self, method: bytes, path: bytes, content_type: bytes | None) -> Wire | None:
        """The wire of an LLM call switchyard reads; None passes the request through unread."""
        route = path.split(b"?", 1)[0].decode("latin-1")
        wire = llm_wire(self.paths, method.decode("latin-1"), route)
        if wire is not None and not json_media(content_type):
            return None  # not JSON: the design passes it through unread
        return wire

    @staticmethod
    def budget_at(headers: Mapping[str, bytes], started_at: float) -> float | None:
        """When the caller's overall budget ends: the shortest valid budget header wins."""
        return budget_end(lambda name: headers.get(name.decode()), started_at)

    async def decide_model(self, ctx: RequestContext, gone: Callable[[], bool]) -> None:
        """Judge (for a route), then variants: `ctx.resolved_model` and `ctx.route`."""
        await self.engine.decide_model(ctx, gone)

    def serving(self, model: str) -> Collection[str]:
        return self.engine.serving(model)

    def machine(self, flight: Started) -> AttemptMachine:
        """The attempt machine of `flight`'s request: its spans hang under the request's."""
        return self.engine.machine(flight.ctx, traced=flight.span is not None, parent=flight.span)

    def reach(self, account: str, model: str) -> Reach:
        """Where the tries of a request for `model` that starts on `account` may go: the
        clusters in turn (`Reach.order`) and how long the accounts there may take
        (`Reach.secs`). Built once per (cluster, model)."""
        cluster = self.cluster_of(account)
        key = (cluster, model)  # bounded: a lease's model is a configured one
        found = self._orders.get(key)
        if found is None:
            order = self.aggregates.order(cluster)
            chains = self.engine.chains
            models = [model]
            if chains is not None:
                models += [*chains.after(model, Reason.UNAVAILABLE)]
                models += [*chains.after(model, Reason.CONTEXT_LENGTH)]
            serving = {a for m in models for a in self.pool.accounts_for(m) if a in self.routable}
            others = frozenset(order[1:])
            if not any(self.cluster_of(a) in others for a in serving):
                order = (cluster,)
            specs = tuple(self.accounts[a].spec for a in serving if self.cluster_of(a) in order)
            start = max((start_secs(spec) for spec in specs), default=0.0)
            alike = len({(spec.timeout_secs, spec.default_max_tokens) for spec in specs}) <= 1
            found = self._orders[key] = Reach(order, specs, start, alike)
        return found

    def routing(self, account: str, order: tuple[str, ...]) -> list[base_pb2.HeaderValueOption]:
        """What a request routed to `account` sets: its key, and its cluster or, when its
        `order` crosses providers, the aggregate's."""
        return self.across_options[account] if len(order) > 1 else self.route_options[account]

    def on(self, cluster: str) -> frozenset[str]:
        """The accounts an attempt sent to `cluster` may go with."""
        return self.on_cluster.get(cluster, frozenset())

    @staticmethod
    def hedged(timeouts: list[tuple[str, bytes]], after_secs: float) -> list[tuple[str, bytes]]:
        """`timeouts` for a request routed to the hedge route (`hedge_tries`): its per-try
        timeout is the hedge time, which starts the hedge and cuts no try (the first-token
        filter bounds each try's first content), and the header that picks the route."""
        kept = [(k, v) for k, v in timeouts if k != PER_TRY_TIMEOUT_HEADER]
        return [*kept, (HEDGE_HEADER, b"1"), (PER_TRY_TIMEOUT_HEADER, _ms(after_secs))]

    def deadline_headers(
        self, machine: AttemptMachine, reach_secs: float = 0.0
    ) -> list[tuple[str, bytes]]:
        """The Envoy timeouts that enforce the attempt's deadline (`machine.deadline`).

        Envoy's per-try timeout ends a try whose answer has not started (it stops at the
        response headers, so it never cuts a long healthy stream), and the route retries it on
        the next account: a stream must start within its time to start, a whole answer is
        timed out when its headers (which come with it) are late. Envoy reads it once and
        keeps it for every try, so it is the longest first bound among the accounts the tries
        may go to (`reach_secs`, `Reach.secs`): no retry is cut before its own
        account's bound. Each try's own bound is the processor's: a stream's first content is
        held to it by the first-token filter's timer, from the try's headers on; before them,
        an account with a shorter bound than another the request may reach is held to the
        longer one.

        The route timeout (`x-envoy-upstream-rq-timeout-ms`) bounds the whole request: what is
        left of the caller's budget, if any; a whole answer's also two of its tries (one timed
        out and the one after it), which bounds an answer whose headers come early and whose
        body does not. The gaps between a stream's chunks are the route's `idle_timeout` in
        envoy.yaml (`stream_idle_secs`).
        """
        view = machine.ctx.view
        if view is None:
            return []
        attempt, left = machine.deadline(time.monotonic())
        if left is None:  # the usual request: the same bounds give the same headers
            key = (attempt, reach_secs, view.stream)
            found = self._timeouts.get(key)
            if found is None:
                if len(self._timeouts) >= _MAX_TIMEOUTS:  # a deadline grows with max_tokens
                    self._timeouts.clear()
                found = self._timeouts[key] = _timeouts(attempt, reach_secs, None, view.stream)
            return found
        return _timeouts(attempt, reach_secs, left, view.stream)


def _timeouts(
    attempt: float, reach_secs: float, left: float | None, stream: bool
) -> list[tuple[str, bytes]]:
    """`Policies.deadline_headers` for an attempt's own bound, the longest of its request's
    tries and what is left of the caller's budget (None: no budget)."""
    per_try = max(attempt, reach_secs)
    total = left if stream else 2 * per_try if left is None else min(2 * per_try, left)
    if left is not None:
        per_try = min(per_try, left)
    headers = [(PER_TRY_TIMEOUT_HEADER, _ms(per_try))]
    if total is not None:
        headers.append((TIMEOUT_HEADER, _ms(total)))
    return headers


class Reach(NamedTuple):
    """Where a request's tries may go (`Policies.reach`)."""

    order: tuple[str, ...]
    """The clusters, attempt after attempt: the aggregate its cluster heads when another
    provider in it serves the model or a model of its fallback chains; else its cluster
    alone, whose other keys then take its retries (through the aggregate they would go to a
    provider with none to serve)."""
    specs: tuple[LLMClient, ...]
    """The accounts on them that serve the model or a model of its chains."""
    start_secs: float
    """The longest time to start among them (0: none)."""
    alike: bool
    """Whether they all give a whole answer the same time (`timeout_secs`,
    `default_max_tokens`): then no try's bound is longer than the first's."""

    def secs(self, view: RequestView | None) -> float:
        """The longest first bound (`attempts.deadline_secs`: a stream's time to start, else
        the time to be whole) among the accounts for the request `view` (0: none, or none
        longer than the first account's own). Envoy reads a request's per-try timeout once,
        for every try: below this, a retry on an account with a longer bound would be cut
        before it."""
        if view is None:
            return 0.0
        if view.stream:
            return self.start_secs
        if self.alike:  # the usual config: every try's bound is the first's own
            return 0.0
        # A whole answer's bound grows with the request's output cap: asked per request.
        return max((deadline_secs(view, spec) for spec in self.specs), default=0.0)
