"""Account pool: picks the upstream account for each attempt and cools faulty ones.

Each account has a circuit breaker. ``failure_threshold`` consecutive faults cool it for its
current period (seconds); once the period has elapsed, one real request is admitted as a probe
(half-open). A probe success closes the breaker and resets the period to ``cooldown_secs``; a
probe fault re-cools it with the period doubled, capped at ``max_cooldown_secs``. A 429 is a
throttle: the caller fails over, but it is never counted and never cools.

Sans-IO: all time comes from the injected :data:`~switchyard_mw.core.clock.Clock`. Every method
runs to completion without awaiting, so the pool is safe to share between the tasks of one event
loop (ASGI handlers and grpc.aio servicers alike); "two concurrent requests never get two probes"
holds because :meth:`AccountPool.acquire` claims the probe slot before it returns. It is *not*
thread-safe: use it from one thread.

The per-account state machine lives in :mod:`~switchyard_mw.core.breaker`, apart from the
selection logic. With a shared store attached (:meth:`AccountPool.attach`, e.g. Redis across
replicas) the pool stays the local view every decision is made from: it tells the store about
transitions that change an account's health and merges what the store reports back
(:meth:`AccountPool.merge`). Only the probe needs the store's word before it is sent: the
caller awaits the store's claim and tells the pool its answer (:meth:`AccountPool.claim_refused`,
:meth:`AccountPool.claim_abandoned`); the engine's attempt machine asks for that claim as an
action its driver performs.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

from switchyard_mw.core import affinity
from switchyard_mw.core.breaker import AccountSpec as AccountSpec
from switchyard_mw.core.breaker import AccountStatus as AccountStatus
from switchyard_mw.core.breaker import Admit, Breaker
from switchyard_mw.core.breaker import BreakerState as BreakerState
from switchyard_mw.core.clock import Clock, monotonic
from switchyard_mw.core.shared import Cause as Cause
from switchyard_mw.core.shared import Change, Shared, StateStore

MAX_HOLDS = 10_000
"""The most throttle holds kept at once. Holds are keyed by account and model, and a wildcard
account serves any model string a client sends; past this, a new hold is not kept (the cost is
one more 429, never a wrong answer)."""

MAX_PAIRS = 10_000
"""The most (account, model) breakers kept at once. Only a pair that faulted has one (it goes
once closed with no fault left), and a wildcard account serves any model string; past this, a
model fault of a new pair counts against the whole account, as every fault did before."""

PROBE_RETRY_AFTER_SECS = 1.0
"""What :meth:`AccountPool.retry_after_secs` reports while the only hope is an in-flight probe:
its outcome could reopen the account any moment, and 1 s is the smallest positive whole
``retry-after`` value."""


class Outcome(enum.Enum):
    """How one attempt against an account ended, as far as its health is concerned."""

    SUCCESS = "success"
    FAULT = "fault"
    THROTTLE = "throttle"


# Read on every attempt: module constants, since Enum member access is slow on Python 3.11
# (see `breaker._CLOSED`).
_SUCCESS, _FAULT, _THROTTLE = Outcome.SUCCESS, Outcome.FAULT, Outcome.THROTTLE
_DENY, _GRANT = Admit.DENY, Admit.GRANT
_CLOSED = BreakerState.CLOSED


def classify_status(status: int) -> Outcome:
    """Map an upstream HTTP status to an :class:`Outcome` (401/402/403/5xx fault, 429 throttle)."""
    if status == 429:
        return _THROTTLE
    if status in (401, 402, 403) or 500 <= status <= 599:
        return _FAULT
    return _SUCCESS


BILLING = "billing"
"""The status metrics show for a billing refusal that arrived as something else (OpenAI's 429
`insufficient_quota`, Anthropic's 400 "credit balance is too low"): read from its body."""
CREDENTIAL_STATUSES = frozenset({"401", "402", "403", BILLING})
"""Fault statuses (as metrics show them) that are credential or billing refusals."""


def fault_cause(status: str) -> Cause:
    """Why an attempt whose status metrics show as `status` ("401", "503", "deadline", ...)
    faulted: a refused key or its billing, or an outage that may heal."""
    return Cause.CREDENTIALS if status in CREDENTIAL_STATUSES else Cause.OUTAGE


@dataclass(frozen=True, slots=True)
class Recovery:
    """When the accounts serving a model can be tried again, apart by whether waiting heals.

    ``heals_in_secs``: the soonest an account that is not cooling for refused credentials can be
    tried (0.0: now; a hold, an outage's cooling or an in-flight probe otherwise), None when
    every account is cooling for refused credentials. ``refused_in_secs``: the soonest probe of
    an account cooling for refused credentials (401, 402, 403), None when none is.
    """

    heals_in_secs: float | None
    refused_in_secs: float | None


@dataclass(frozen=True, slots=True, eq=False)
class Lease:
    """Permission to send one attempt to ``account``; give it back via record() or release().

    Compared by identity: a stale probe lease (already recorded or released) is then not
    mistaken for the probe currently in flight. ``model``: the attempt's model where the account
    keeps model faults per (account, model) (it serves several models), else None.
    ``pair_probe``: the probe is that pair's, not the account's (its key or billing).
    """

    account: str
    probe: bool
    model: str | None = None
    pair_probe: bool = False

    @property
    def unit(self) -> str | None:
        """Whose probe this is: the model of the pair probed, None for the account's own."""
        return self.model if self.pair_probe else None


class _Group:
    """Accounts of one priority serving one model, with its round-robin cursor (requests
    without a conversation key) and each member's rendezvous seed and weight (with one)."""

    __slots__ = ("cursor", "members", "seeds", "weights")

    def __init__(self, members: tuple[Breaker, ...]) -> None:
        self.members = members
        self.cursor = 0
        self.seeds = tuple(affinity.seed(b.name) for b in members)
        self.weights = tuple(b.spec.weight for b in members)

    def rendezvous(self, key: int) -> list[Breaker]:
        """The members in the key's rendezvous order (best first)."""
        members = self.members
        return [members[i] for i in affinity.order(key, self.seeds, self.weights)]


class _Route:
    """Everything acquire() needs for one model, precomputed: groups in priority order."""

    __slots__ = ("breakers", "groups", "names")

    def __init__(self, breakers: Iterable[Breaker]) -> None:
        # Stable sort: within a priority, config order sets the round-robin order.
        ordered = sorted(breakers, key=lambda b: b.spec.priority)
        self.breakers = tuple(ordered)
        self.names = tuple(b.name for b in ordered)
        groups: dict[int, list[Breaker]] = {}
        for b in ordered:
            groups.setdefault(b.spec.priority, []).append(b)
        self.groups = tuple(_Group(tuple(g)) for g in groups.values())


class AccountPool:
    """Chooses accounts per attempt and tracks their health. Not thread-safe (see module doc)."""

    def __init__(self, accounts: Sequence[AccountSpec], *, clock: Clock = monotonic) -> None:
        self._clock = clock
        self._breakers: dict[str, Breaker] = {}
        for spec in accounts:
            if spec.name in self._breakers:
                raise ValueError(f"duplicate account name {spec.name!r}")
            self._breakers[spec.name] = Breaker(spec)
        # A plain grant carries no identity that matters (only probes are told apart), so each
        # account's is made once rather than per attempt.
        self._grants = {name: Lease(name, False) for name in self._breakers}
        self._split_grants: dict[tuple[str, str], Lease] = {}  # the same per (account, model)
        # Only models some account names explicitly get their own cached route, so the cache is
        # bounded by the config, not by whatever model strings clients send. Every other model is
        # served by the "*" accounts alone, through one shared route.
        self._explicit = frozenset(m for s in accounts for m in s.models if m != "*")
        self._routes: dict[str, _Route] = {}
        wildcard = [b for b in self._breakers.values() if "*" in b.spec.models]
        self._wildcard: _Route | None = _Route(wildcard) if wildcard else None
        # The lease currently probing each account (model None) or pair, to tell it apart from
        # stale probe leases.
        self._probes: dict[tuple[str, str | None], Lease] = {}
        # Accounts serving several models keep model faults per (account, model): a breaker
        # per pair that faulted, made when it first faults and dropped once healthy again.
        # An account serving one model keeps every fault on its own breaker, as before.
        self._split = frozenset(s.name for s in accounts if _splits(s))
        self._pairs: dict[tuple[str, str], Breaker] = {}
        self._store: StateStore | None = None
        # Throttle holds: (account, model) -> clock time the hold ends. Apart from the breakers:
        # a hold is neither a fault nor a cooling, and it concerns one model only.
        self._holds: dict[tuple[str, str], float] = {}
        # The pool of the config reloaded after this one's (see `carry_over`).
        self._successor: AccountPool | None = None

    @property
    def names(self) -> tuple[str, ...]:
        """Every account's name, in config order."""
        return tuple(self._breakers)

    def spec_of(self, name: str) -> AccountSpec:
        """One account's config; KeyError if unknown."""
        return self._breakers[name].spec

    @property
    def named_models(self) -> frozenset[str]:
        """Every model some account names explicitly (not through `"*"`)."""
        return self._explicit

    @property
    def specs(self) -> tuple[AccountSpec, ...]:
        """Every account's config, in config order."""
        return tuple(b.spec for b in self._breakers.values())

    @property
    def clock(self) -> Clock:
        """The clock every time in this pool is read from."""
        return self._clock

    @property
    def shared(self) -> bool:
        """Whether a store shares this pool's state (then a probe lease needs its claim)."""
        return self._store is not None

    def attach(self, store: StateStore | None) -> None:
        """Share state through ``store`` from now on (None: local state only)."""
        self._store = store

    def carry_over(self, old: AccountPool, *, accounts: Collection[str] | None = None) -> None:
        """Keep `old`'s health for `accounts` (default: every name both pools have).

        For a reload: call it on the new config's pool before the pool is used. Each kept
        account keeps its breaker (fault count, cooling and its end, period, the probe in
        flight) and its throttle holds; the new config's settings (threshold, periods,
        models, priority) rule from now on. The breaker is shared, not copied, so a request
        still running on `old` records its outcome where this pool reads it, and a hold it
        places later is kept here too. Accounts not kept start closed. Both pools must read
        the same clock (a cooling's end is a time on it).
        """
        if old._clock is not self._clock:
            raise ValueError("carry_over: the two pools read different clocks")
        kept = set(self._breakers).intersection(old._breakers)
        if accounts is not None:
            kept.intersection_update(accounts)
        for name in kept:
            breaker = old._breakers[name]
            breaker.respec(self._breakers[name].spec)
            self._breakers[name] = breaker
            probe = old._probes.get((name, None))
            if probe is not None:
                self._probes[(name, None)] = probe
        for (name, model), until in old._holds.items():
            if name in kept:
                self._holds[(name, model)] = until
        self._carry_pairs(old, kept)
        # Routes hold breakers: rebuild them over the kept ones.
        self._routes.clear()
        wildcard = [b for b in self._breakers.values() if "*" in b.spec.models]
        self._wildcard = _Route(wildcard) if wildcard else None
        old._successor = self

    def _carry_pairs(self, old: AccountPool, kept: set[str]) -> None:
        """Keep `old`'s pair breakers of `kept` accounts that still keep faults per model and
        still serve the model (shared, like the accounts' breakers)."""
        for (name, model), pair in old._pairs.items():
            if name in kept and name in self._split and self._breakers[name].spec.serves(model):
                pair.respec(self._breakers[name].spec)
                self._pairs[(name, model)] = pair
                probe = old._probes.get((name, model))
                if probe is not None:
                    self._probes[(name, model)] = probe

    def _route(self, model: str) -> _Route | None:
        route = self._routes.get(model)
        if route is not None:
            return route
        if model not in self._explicit:
            return self._wildcard
        route = _Route(b for b in self._breakers.values() if b.spec.serves(model))
        self._routes[model] = route
        return route

    def accounts_for(self, model: str) -> tuple[str, ...]:
        """Every account serving ``model`` in priority, then config, order; ignores health."""
        route = self._route(model)
        return route.names if route is not None else ()

    def acquire(
        self,
        model: str,
        *,
        exclude: Collection[str] = (),
        allowed: Collection[str] | None = None,
        key: int | Callable[[], int | None] | None = None,
    ) -> Lease | None:
        """The next account to try for ``model``, or None when none is eligible.

        Eligible: serves the model, not in ``exclude``, in ``allowed`` if given, and closed or
        due a probe (then the lease has ``probe=True`` and nobody else gets that account until
        the lease is recorded or released). Lowest priority value first. Within a priority, a
        request with a conversation ``key`` (:func:`~switchyard_mw.core.affinity.key_hash`)
        takes the first eligible account in the key's rendezvous order; one without takes
        turns (round-robin per model and priority). ``key`` may be a function giving it: then
        it is worked out only where a priority of several accounts reads it.
        """
        route = self._routes.get(model) or self._route(model)
        if route is None:
            return None
        now = self._clock()
        # The usual first attempt: nothing excluded, held or out of reach, so every account
        # is eligible as far as its breaker goes (`_eligible` is not asked).
        open_ = not exclude and allowed is None and not self._holds
        for group in route.groups:
            members = group.members
            if key is not None and len(members) > 1:
                if not isinstance(key, int):
                    key = key()
                if key is not None:
                    lease = self._by_key(group, key, model, now, exclude, allowed)
                    if lease is not None:
                        return lease
                    continue
            n = len(members)
            idx = group.cursor
            for _ in range(n):
                b = members[idx]
                idx = idx + 1 if idx + 1 < n else 0
                if open_ or self._eligible(b, model, now, exclude, allowed):
                    # Next caller starts after this account: even spreading within the group.
                    lease = self._lease(b, model, now)
                    if lease is not None:
                        group.cursor = idx
                        return lease
        return None

    def _by_key(
        self,
        group: _Group,
        key: int,
        model: str,
        now: float,
        exclude: Collection[str],
        allowed: Collection[str] | None,
    ) -> Lease | None:
        """The conversation's account in `group`, else the next in its order: a cooled, held
        or tried account moves only its own conversations."""
        for b in group.rendezvous(key):
            if self._eligible(b, model, now, exclude, allowed):
                lease = self._lease(b, model, now)
                if lease is not None:
                    return lease
        return None

    def lease_again(self, account: str, model: str) -> Lease | None:
        """A lease on `account` alone for `model`, its throttle hold for the model aside, or
        None when its breaker admits no attempt now (a probe claims its slot, as `acquire`).

        For a retry in place: the caller waited out the retry time of the 429 that set the
        hold, and a hold that ends a clock tick after the wait (or one a reload carried over)
        must not turn that retry into a local refusal. Cooling is not set aside: an account
        its own fault cooled is not retried.
        """
        b = self._breakers.get(account)
        route = self._route(model)
        if b is None or route is None or b not in route.breakers:
            return None
        return self._lease(b, model, self._clock())

    def cooling_secs(self, account: str, model: str) -> float:
        """Seconds until `account` admits an attempt for `model` (0.0: now), holds aside: its
        cooling, and the (account, model) pair's where model faults are kept apart."""
        return self._wait(self._breakers[account], model, self._clock())

    def _eligible(
        self,
        b: Breaker,
        model: str,
        now: float,
        exclude: Collection[str],
        allowed: Collection[str] | None,
    ) -> bool:
        """Whether `b` may take an attempt for `model`, its breaker aside."""
        if b.name in exclude or (allowed is not None and b.name not in allowed):
            return False
        holds = self._holds
        return not (holds and holds.get((b.name, model), -math.inf) > now)

    def _lease(self, b: Breaker, model: str, now: float) -> Lease | None:
        """A lease on `b` if its breaker admits an attempt now (a probe claims its slot)."""
        name = b.name
        if b.state is _CLOSED:
            # The usual lease: a closed breaker grants, and a plain grant is made once (per
            # account, or per pair where the account has no pair breaker for the model).
            if name not in self._split:
                return self._grants[name]
            if not self._pairs or (name, model) not in self._pairs:
                lease = self._split_grants.get((name, model))
                if lease is not None:
                    return lease
        if name in self._split:
            return self._split_lease(b, model, now)
        admit = b.admit(now)
        if admit is _DENY:
            return None
        if admit is _GRANT:
            return self._grants[b.name]
        lease = Lease(b.name, True)
        self._probes[(b.name, None)] = lease
        return lease

    def _split_lease(self, b: Breaker, model: str, now: float) -> Lease | None:
        """A lease on an account that keeps model faults per pair: the account's own breaker
        first (a refused key shuts every model out), then the pair's."""
        if b.state is not _CLOSED:
            admit = b.admit(now)
            if admit is _DENY:
                return None
            if admit is not _GRANT:
                lease = Lease(b.name, True, model)
                self._probes[(b.name, None)] = lease
                return lease
        pair = self._pairs.get((b.name, model)) if self._pairs else None
        if pair is None:
            return self._split_grant(b.name, model)
        admit = pair.admit(now)
        if admit is _DENY:
            return None
        if admit is _GRANT:
            return self._split_grant(b.name, model)
        lease = Lease(b.name, True, model, pair_probe=True)
        self._probes[(b.name, model)] = lease
        return lease

    def _split_grant(self, name: str, model: str) -> Lease:
        """A plain grant on `name` for `model`: like `_grants`, made once per pair and shared
        (only a probe's lease is told apart by identity), at most MAX_PAIRS of them kept (a
        wildcard account serves any model string a client sends)."""
        grants = self._split_grants
        lease = grants.get((name, model))
        if lease is None:
            lease = Lease(name, False, model)
            if len(grants) >= MAX_PAIRS:
                grants.clear()
            grants[(name, model)] = lease
        return lease

    def _successor_of(self, name: str) -> AccountPool | None:
        """The pool a reload kept `name`'s health in (it sharing this pool's breaker), if any:
        a pair that faults on a request still running here is kept there."""
        successor = self._successor
        if successor is not None and successor._breakers.get(name) is self._breakers[name]:
            return successor
        return None

    def _breaker(self, name: str, unit: str | None) -> Breaker | None:
        """The breaker of `name` (unit None) or of its pair with model `unit` (None if none)."""
        if unit is None:
            return self._breakers[name]
        pair = self._pairs.get((name, unit))
        if pair is None and (successor := self._successor_of(name)) is not None:
            return successor._breaker(name, unit)
        return pair

    def _pair(self, name: str, model: str) -> Breaker | None:
        """The pair breaker of (`name`, `model`), made if needed; None when `name` keeps no
        pairs, does not serve `model`, or MAX_PAIRS are kept (its faults go to the account)."""
        pair = self._pairs.get((name, model))
        if pair is not None or name not in self._split:
            return pair
        if (successor := self._successor_of(name)) is not None:
            return successor._pair(name, model)
        b = self._breakers[name]
        if not b.spec.serves(model) or len(self._pairs) >= MAX_PAIRS:
            return None
        pair = self._pairs[(name, model)] = Breaker(b.spec)
        return pair

    def _prune(self, name: str, unit: str | None) -> None:
        """Drop the pair breaker of (`name`, `unit`) once it is as a new one would be."""
        if unit is None:
            return
        pair = self._pairs.get((name, unit))
        idle = pair is not None and pair.state is _CLOSED and not pair.faults
        if idle and (name, unit) not in self._probes:
            del self._pairs[(name, unit)]
        if (successor := self._successor_of(name)) is not None:
            successor._prune(name, unit)

    @property
    def store(self) -> StateStore | None:
        """The store this pool shares its state through (None: local state only).

        A probe lease from :meth:`acquire` is only this replica's once the store agrees: the
        caller awaits ``store.claim_probe(lease.account)`` and hands the answer back through
        :meth:`claim_refused` (or :meth:`claim_abandoned` when the claim never answered). The
        pool itself never waits.
        """
        return self._store

    def claim_refused(self, lease: Lease, shared: Shared) -> None:
        """The store gave ``lease``'s probe slot to another replica (or knows of a longer
        cooling): the local slot goes back without an outcome and ``shared`` is merged, so the
        next :meth:`acquire` skips that account or pair (a refusal per probe slot at most)."""
        self.claim_abandoned(lease)
        self.merge(lease.account, shared, model=lease.unit)

    def claim_abandoned(self, lease: Lease) -> None:
        """The claim for ``lease``'s probe slot was cancelled or failed: the local slot goes
        back, or the account would stay half-open with no probe ever answering."""
        probe = self._take_probe(lease)
        b = self._breaker(lease.account, lease.unit)
        if b is not None:
            b.on_release(probe)

    def merge(self, name: str, shared: Shared, *, model: str | None = None) -> None:
        """Take in an account's state (with `model`: that pair's) as the shared store reports
        it (unknown names: ignored, another replica may run a newer config). A cooling end
        only ever moves later."""
        if name not in self._breakers:
            return
        if model is None:
            self._breakers[name].merge(self._clock(), shared)
            return
        pair = self._pairs.get((name, model))
        if pair is None and (shared.closed or shared.cooled_for_secs is None):
            return  # nothing to learn about a pair this replica holds no fault of
        pair = pair or self._pair(name, model)
        if pair is not None:
            pair.merge(self._clock(), shared)
            self._prune(name, model)

    def view(self, name: str, *, model: str | None = None) -> Shared:
        """One account's (with `model`: that pair's) local state as a :class:`Shared`
        snapshot; KeyError if the account is unknown (a pair with no fault: a closed one)."""
        b = self._breakers[name]
        if model is not None:
            b = self._pairs.get((name, model)) or Breaker(b.spec)
        return b.view(self._clock())

    def pairs(self) -> list[tuple[str, str]]:
        """Every (account, model) with a breaker of its own now: those that faulted."""
        return list(self._pairs)

    def _take_probe(self, lease: Lease) -> bool:
        """Whether ``lease`` is its account's (or pair's) live probe; if so, it stops being one."""
        if not lease.probe:
            return False
        key = (lease.account, lease.unit)
        if self._probes.get(key) is lease:
            del self._probes[key]
            return True
        return False

    def record(self, lease: Lease, outcome: Outcome, cause: Cause = Cause.OUTAGE) -> None:
        """Feed back how the attempt under ``lease`` ended. Record each lease once.

        ``cause``: for a fault, whether it was a credential refusal (see :func:`fault_cause`).
        """
        if (
            outcome is _SUCCESS
            and not lease.probe
            and self._successor is None
            and not self._breakers[lease.account].faults
            and (lease.model is None or (lease.account, lease.model) not in self._pairs)
        ):
            # The usual record: a success that is no probe's, on an account with no fault
            # counted and no pair breaker for the model (the account's count is 0 already, a
            # pair that never faulted has none). Nothing to walk, nothing to tell the store.
            return
        if lease.model is not None:
            self._record_split(lease, outcome, cause)
            return
        self._apply(self._breakers[lease.account], None, self._take_probe(lease), outcome, cause)

    def _record_split(self, lease: Lease, outcome: Outcome, cause: Cause) -> None:
        """`record` for an account keeping model faults per pair: a refused key or billing is
        the account's fault, any other fault its pair's; a success is proof for both."""
        name, model = lease.account, lease.model
        assert model is not None
        probe = self._take_probe(lease)
        refused = outcome is _FAULT and cause is Cause.CREDENTIALS
        if lease.pair_probe and refused:
            # The pair's probe met a refused key: its slot goes back, the account takes it.
            self._apply_pair(name, model, probe, None, cause)
            probe = False
        unit = lease.unit if probe else self._unit_of(name, model, outcome, refused)
        self._apply_pair(name, unit, probe, outcome, cause)
        if outcome is _SUCCESS:
            # The key works (the account's count resets), and so does the model (the pair's).
            self._apply_pair(name, model if unit is None else None, False, outcome, cause)

    def _unit_of(self, name: str, model: str, outcome: Outcome, refused: bool) -> str | None:
        """Where an outcome that is no probe's lands: a model fault on its pair (None when
        no pair can be kept), anything else on the account."""
        if outcome is _FAULT and not refused and self._pair(name, model) is not None:
            return model
        return None

    def _apply_pair(
        self, name: str, unit: str | None, probe: bool, outcome: Outcome | None, cause: Cause
    ) -> None:
        """Apply an outcome (None: a release) to the account (unit None) or the pair."""
        b = self._breaker(name, unit)
        if b is None:
            return  # a pair that never faulted: a success changes nothing there
        if outcome is None:
            b.on_release(probe)
            if probe and self._store is not None:
                self._changed(b, unit, Change.PROBE_FREED)
        else:
            self._apply(b, unit, probe, outcome, cause)
        self._prune(name, unit)

    def _changed(self, b: Breaker, unit: str | None, change: Change) -> None:
        store = self._store
        assert store is not None
        if unit is None:
            store.changed(b.name, change, b.view(self._clock()))
        else:
            store.changed(b.name, change, b.view(self._clock()), model=unit)

    def _apply(
        self, b: Breaker, unit: str | None, probe: bool, outcome: Outcome, cause: Cause
    ) -> None:
        """An outcome on breaker `b` (an account's, or its pair with model `unit`)."""
        closed, faults = b.state is _CLOSED, b.faults
        change: Change | None = None
        if outcome is _FAULT:
            b.on_fault(self._clock(), probe, cause)
            if probe:
                change = Change.PROBE_FAULT
            elif closed:
                change = Change.FAULT
        elif outcome is _SUCCESS:
            b.on_success(probe)
            if probe:
                change = Change.PROBE_SUCCESS
            elif closed and faults:
                change = Change.RESET
        else:
            b.on_throttle(probe)
            if probe:
                change = Change.PROBE_FREED
        # A success on a healthy account changes nothing: the hot path never reaches the store.
        if change is not None and self._store is not None:
            self._changed(b, unit, change)

    def release(self, lease: Lease) -> None:
        """The attempt ended without an outcome (e.g. client gone): free a probe slot only."""
        probe = self._take_probe(lease)
        if lease.model is not None:
            self._apply_pair(lease.account, lease.unit, probe, None, Cause.OUTAGE)
            return
        b = self._breakers[lease.account]
        b.on_release(probe)
        if probe and self._store is not None:
            self._changed(b, None, Change.PROBE_FREED)

    def retry_after_secs(
        self, model: str, *, allowed: Collection[str] | None = None
    ) -> float | None:
        """Seconds until the earliest account serving ``model`` (and in ``allowed`` if given) can
        be tried; None if no such account exists.

        0.0 when one is eligible right now (the caller presumably excluded it, e.g. after a 429:
        prefer the upstream's own ``retry-after`` then). :data:`PROBE_RETRY_AFTER_SECS` when the
        soonest chance is an in-flight probe, whose outcome time is unknown.
        """
        route = self._route(model)
        if route is None:
            return None
        now = self._clock()
        holds = self._holds
        best: float | None = None
        for b in route.breakers:
            if allowed is not None and b.name not in allowed:
                continue
            wait = self._wait(b, model, now)
            if holds:
                # Held, and maybe cooled too: it is back when both are over.
                wait = max(wait, holds.get((b.name, model), -math.inf) - now)
            if wait <= 0.0:
                return 0.0
            if best is None or wait < best:
                best = wait
        return best

    def recovery(self, model: str, *, allowed: Collection[str] | None = None) -> Recovery | None:
        """:meth:`retry_after_secs`, told apart by cause: when the accounts serving ``model``
        (and in ``allowed`` if given) that waiting can heal are back, and when the probe of
        those cooling for refused credentials is due. None if no such account exists."""
        route = self._route(model)
        if route is None:
            return None
        now = self._clock()
        heals: float | None = None
        refused: float | None = None
        found = False
        for b in route.breakers:
            if allowed is not None and b.name not in allowed:
                continue
            found = True
            wait = max(self._wait(b, model, now), self._holds.get((b.name, model), -math.inf) - now)
            wait = max(wait, 0.0)
            if b.state is not _CLOSED and b.cause is Cause.CREDENTIALS:
                refused = wait if refused is None else min(refused, wait)
            else:
                heals = wait if heals is None else min(heals, wait)
        return Recovery(heals, refused) if found else None

    def _wait(self, b: Breaker, model: str, now: float) -> float:
        """Seconds until `b` admits an attempt for `model`: its own breaker's and its pair's."""
        wait = _cooling_wait(b, now)
        pair = self._pairs.get((b.name, model)) if self._pairs else None
        return wait if pair is None else max(wait, _cooling_wait(pair, now))

    # --- throttle holds -------------------------------------------------------------------

    def hold(
        self, account: str, model: str, secs: float, *, wall_now: float | None = None
    ) -> float:
        """Keep `account` out of rotation for `model` for `secs` (a 429's retry time).

        Capped by the account's `max_throttle_secs`; a hold never shortens a longer one in
        force. Not a fault and not a cooling: the breaker is untouched. Returns the seconds
        held from now (0.0 when nothing is held: no time asked, or no room left). With a store
        attached, the hold is shared: `wall_now` (Unix time) dates it for the other replicas.
        """
        held = self._hold(account, model, secs)
        if held > 0 and self._store is not None and wall_now is not None:
            self._store.held(account, model, wall_now + held)
        return held

    def merge_hold(self, account: str, model: str, secs: float) -> None:
        """Take in a hold another replica started (`secs` from now); unknown accounts: ignored."""
        if account in self._breakers:
            self._hold(account, model, secs)

    def _hold(self, account: str, model: str, secs: float) -> float:
        b = self._breakers[account]
        successor = self._successor
        if successor is not None and successor._breakers.get(account) is b:
            return successor._hold(account, model, secs)  # kept by a reload: held there
        secs = min(secs, b.spec.max_throttle_secs)
        if not secs > 0:
            return 0.0
        now = self._clock()
        key = (account, model)
        until = max(now + secs, self._holds.get(key, -math.inf))
        if key not in self._holds and len(self._holds) >= MAX_HOLDS:
            self._prune_holds(now)
            if len(self._holds) >= MAX_HOLDS:
                return 0.0
        self._holds[key] = until
        return until - now

    def _prune_holds(self, now: float) -> None:
        for key in [k for k, until in self._holds.items() if until <= now]:
            del self._holds[key]

    def hold_count(self) -> int:
        """Holds kept now, ended ones included until they are pruned."""
        return len(self._holds)

    def holds_of(self, account: str) -> dict[str, float]:
        """Each model `account` is held for now, with the clock time its hold ends."""
        now = self._clock()
        return {m: until for (a, m), until in self._holds.items() if a == account and until > now}

    def throttled(self, model: str) -> bool:
        """Whether an account serving `model` is held for it now (so a 429 explains the wait)."""
        if not self._holds:
            return False
        now = self._clock()
        return any(
            self._holds.get((name, model), -math.inf) > now for name in self.accounts_for(model)
        )

    def status(self) -> list[AccountStatus]:
        """Snapshot of every account, in config order."""
        now = self._clock()
        return [b.snapshot(now) for b in self._breakers.values()]

    def status_of(self, name: str, *, model: str | None = None) -> AccountStatus:
        """Snapshot of one account (with `model`: of that pair, closed if it never faulted);
        KeyError if unknown."""
        b = self._breakers[name]
        if model is not None:
            b = self._pairs.get((name, model)) or Breaker(b.spec)
        return b.snapshot(self._clock())

    def closed_for(self, name: str, model: str) -> bool:
        """Whether `name` is closed for `model`: its own breaker, and that pair's if it has
        one (no lease is taken); KeyError if unknown."""
        if self._breakers[name].state is not _CLOSED:
            return False
        pair = self._pairs.get((name, model)) if self._pairs else None
        return pair is None or pair.state is _CLOSED

    def pair_status(self, name: str) -> dict[str, AccountStatus]:
        """Each model of `name` whose health differs from the account's own, with its state:
        the pairs that faulted (model faults count per model where an account serves
        several)."""
        now = self._clock()
        return {m: pair.snapshot(now) for (a, m), pair in self._pairs.items() if a == name}


def _splits(spec: AccountSpec) -> bool:
    """Whether `spec`'s model faults are kept per (account, model): it serves several."""
    return len(spec.models) > 1 or "*" in spec.models


def _cooling_wait(b: Breaker, now: float) -> float:
    """Seconds until the breaker admits an attempt (0.0: now), holds aside."""
    if b.state is _CLOSED:
        return 0.0
    if b.probe_in_flight or b.cooled_until <= now < b.probe_elsewhere_until:
        return PROBE_RETRY_AFTER_SECS
    if b.state is BreakerState.HALF_OPEN:
        return 0.0
    return max(0.0, b.cooled_until - now)
