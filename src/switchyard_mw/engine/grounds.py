"""`Grounds`: what one engine's attempt machines decide with, built once per config.

An `AttemptMachine` is given its grounds when it is built and asks nothing else: the account
pool and the accounts, the accounts the front can send to (`routable`), the canaries (what an
attempt's end counts for a variant), the fallback chains, the clock, and a `Recorder` for its
spans, metrics and logs. The `Engine` builds one `Grounds` with its config and holds it; a
reload builds another engine and so other grounds (requests keep theirs).

What is decided here is what the machine and the engine both ask of the pool: which accounts
serve a model, what answers when none can, and what an attempt's end means for its account.
"""

from __future__ import annotations

from collections.abc import Collection

from ..accounts import Account
from ..config import Server
from ..context import RequestContext
from ..core.clock import Clock, monotonic
from ..core.pool import AccountPool, Lease, Outcome
from ..wire import WireError
from . import answers
from .fallbacks import Chains
from .hedging import Hedging
from .outcomes import hold, probed, settle
from .recorder import Recorder
from .variants import Canaries

_SUCCESS, _FAULT, _THROTTLE = Outcome.SUCCESS, Outcome.FAULT, Outcome.THROTTLE


class Grounds:
    """The pool, accounts, canaries, chains, clock and recorder of one engine's machines.

    `routable`: the accounts the front can send a request to (None: all of them);
    `chains`: the config's fallback chains (None: none); `rewrites_retries`: the front
    rewrites the body of a retry it makes on its own (Envoy's), so a fallback chain may move
    a request once the front committed to a cluster; `hedging`: hedged first tokens (None: no
    account hedges, or the front does not race).
    """

    __slots__ = (
        "_uncounting",
        "accounts",
        "canaries",
        "chains",
        "clock",
        "hedging",
        "pool",
        "recorder",
        "renaming",
        "resumes_streams",
        "rewrites_retries",
        "routable",
        "server",
    )

    def __init__(
        self,
        *,
        server: Server,
        accounts: dict[str, Account],
        pool: AccountPool,
        canaries: Canaries | None = None,
        routable: frozenset[str] | None = None,
        chains: Chains | None = None,
        clock: Clock = monotonic,
    ) -> None:
        self.server = server
        self.accounts = accounts
        self.pool = pool
        self.canaries = canaries
        self.routable = routable
        self.chains = chains if chains else None
        self.rewrites_retries = False
        self.hedging: Hedging | None = None
        self.clock = clock
        """What a request's budget is read against (`ctx.budget_at`): `time.monotonic`."""
        self.recorder = Recorder(accounts)
        self._uncounting = frozenset(n for n, a in accounts.items() if not a.counts_tokens)
        self.renaming = frozenset(n for n, a in accounts.items() if a.renames)
        """The accounts an attempt is bound to its model for (`Account.for_model`): those
        whose body or path may carry another name than the client's."""
        self.resumes_streams = server.resume_streams or any(
            a.spec.resume_streams for a in accounts.values()
        )
        """Whether a broken stream may be continued on another account (`resume_streams`,
        the server's or some account's): only then is a stream watched for its break."""

    # --- which accounts serve -----------------------------------------------------------

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
        return model is not None and (
            bool(self.serving(model)) or self.takeover_base(ctx) is not None
        )

    def takeover_base(self, ctx: RequestContext) -> str | None:
        """The canary's base model, if it may take over (`ctx.canary_base`) and is served."""
        base = ctx.canary_base()
        return base if base is not None and self.serving(base) else None

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
        pool = self.pool
        if refused or skipped:
            names = pool.names if allowed is None else allowed
            allowed = frozenset(n for n in names if n not in refused and n not in skipped)
        found = [
            pool.recovery(model, allowed=allowed)
            for model in (ctx.resolved_model, self.takeover_base(ctx))
            if model is not None
        ]
        heals = [r.heals_in_secs for r in found if r is not None and r.heals_in_secs is not None]
        cooling = [
            r.refused_in_secs for r in found if r is not None and r.refused_in_secs is not None
        ]
        model = ctx.resolved_model
        throttled = model is not None and pool.throttled(model)
        return answers.nothing_serves(
            model,
            throttled=throttled,
            heals_in_secs=min(heals, default=None),
            refused_in_secs=min(cooling, default=None),
            refused_now=bool(refused),
        )

    # --- an attempt's account -----------------------------------------------------------

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

    def settle(
        self,
        lease: Lease,
        outcome: Outcome | None,
        status: str,
        model: str | None,
        retry: list[tuple[str, str]] | None = None,
    ) -> None:
        """Give the lease back with what the attempt said about the account's health (None:
        nothing); the canary guards count it, and a 429's retry-time headers (`retry`) hold
        its account out for the model."""
        canaries = self.canaries
        if canaries is not None and outcome is not None and model is not None:
            canaries.record(model, fault=outcome is _FAULT)
        settle(self.pool, lease, outcome, status)
        if outcome is _THROTTLE and retry and model is not None:
            hold(self.pool, lease.account, model, retry)

    def succeeded(self, lease: Lease, model: str | None) -> None:
        """`settle` for the usual attempt, a success with no span: nothing to count or show."""
        self.pool.record(lease, _SUCCESS)
        if lease.probe:
            probed(self.pool, lease, _SUCCESS, "200")
        canaries = self.canaries
        if canaries is not None and model is not None and model in canaries.guarded:
            canaries.record(model, fault=False)
