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

The per-account state machine lives in :class:`_Breaker`, apart from the selection logic, so a
shared store (e.g. Redis) can later replace it without touching the ordering.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from switchyard_mw.core.clock import Clock, monotonic

PROBE_RETRY_AFTER_SECS = 1.0
"""What :meth:`AccountPool.retry_after_secs` reports while the only hope is an in-flight probe:
its outcome could reopen the account any moment, and 1 s is the smallest positive whole
``retry-after`` value."""


class Outcome(enum.Enum):
    """How one attempt against an account ended, as far as its health is concerned."""

    SUCCESS = "success"
    FAULT = "fault"
    THROTTLE = "throttle"


def classify_status(status: int) -> Outcome:
    """Map an upstream HTTP status to an :class:`Outcome` (401/402/403/5xx fault, 429 throttle)."""
    if status == 429:
        return Outcome.THROTTLE
    if status in (401, 402, 403) or 500 <= status <= 599:
        return Outcome.FAULT
    return Outcome.SUCCESS


@dataclass(frozen=True, slots=True, kw_only=True)
class AccountSpec:
    """Static config of one upstream account.

    ``models`` lists the model names it serves (``"*"`` serves any); lower ``priority`` is
    preferred and equal priorities share traffic; times are in seconds.
    """

    name: str
    models: frozenset[str]
    priority: int = 0
    failure_threshold: int = 3
    cooldown_secs: float = 30.0
    max_cooldown_secs: float = 300.0

    def __post_init__(self) -> None:
        # A bare string would silently become a set of characters.
        if isinstance(self.models, str):
            raise TypeError(f"account {self.name!r}: models must be a collection, not a str")
        # Config loaders hand over lists; normalise so `serves` is a set lookup.
        object.__setattr__(self, "models", frozenset(self.models))
        if self.failure_threshold < 1:
            raise ValueError(f"account {self.name!r}: failure_threshold must be >= 1")
        if not self.cooldown_secs > 0:
            raise ValueError(f"account {self.name!r}: cooldown_secs must be > 0")
        if not self.max_cooldown_secs >= self.cooldown_secs:
            raise ValueError(f"account {self.name!r}: max_cooldown_secs must be >= cooldown_secs")

    def serves(self, model: str) -> bool:
        """Whether this account may be used for ``model``."""
        return "*" in self.models or model in self.models


class BreakerState(enum.Enum):
    """``COOLED`` lasts until a probe is admitted, even after ``cooled_until`` has passed."""

    CLOSED = "closed"
    COOLED = "cooled"
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class AccountStatus:
    """Snapshot of one account for operators; ``cooled_until`` is clock time (s), else None."""

    name: str
    state: BreakerState
    consecutive_faults: int
    cooled_until: float | None
    current_cooldown_secs: float
    probe_in_flight: bool


@dataclass(frozen=True, slots=True, eq=False)
class Lease:
    """Permission to send one attempt to ``account``; give it back via record() or release().

    Compared by identity: a stale probe lease (already recorded or released) is then not
    mistaken for the probe currently in flight.
    """

    account: str
    probe: bool


class _Admit(enum.Enum):
    """Answer of :meth:`_Breaker.admit`."""

    DENY = 0
    GRANT = 1
    PROBE = 2


class _Breaker:
    """One account's breaker state and transitions; the only mutable per-account state."""

    __slots__ = ("cooled_until", "faults", "name", "period", "probe_in_flight", "spec", "state")

    def __init__(self, spec: AccountSpec) -> None:
        self.spec = spec
        self.name = spec.name
        self.state = BreakerState.CLOSED
        self.faults = 0
        # -inf so `max()` keeps cooling end monotonic from the first cooling on.
        self.cooled_until = -math.inf
        self.period = spec.cooldown_secs
        self.probe_in_flight = False

    def admit(self, now: float) -> _Admit:
        """Whether an attempt may start at ``now``; PROBE claims the single probe slot."""
        if self.state is BreakerState.CLOSED:
            return _Admit.GRANT
        if self.probe_in_flight or (self.state is BreakerState.COOLED and now < self.cooled_until):
            return _Admit.DENY
        self.state = BreakerState.HALF_OPEN
        self.probe_in_flight = True
        return _Admit.PROBE

    def on_fault(self, now: float, probe: bool) -> None:
        self.faults += 1
        if probe:
            self.probe_in_flight = False
            self.period = min(self.period * 2, self.spec.max_cooldown_secs)
            self._cool(now)
        elif self.state is BreakerState.CLOSED and self.faults >= self.spec.failure_threshold:
            self._cool(now)
        # Otherwise a straggler acquired before the cooling: the account is already being dealt
        # with, so it must neither restart the cooling nor double the period.

    def on_success(self, probe: bool) -> None:
        self.faults = 0
        if probe:
            self.probe_in_flight = False
            self.state = BreakerState.CLOSED
            self.period = self.spec.cooldown_secs

    def on_throttle(self, probe: bool) -> None:
        # A 429 says nothing about the account's health (nor does a release, which shares this):
        # free the slot so the next caller probes, stay half-open.
        if probe:
            self.probe_in_flight = False

    on_release = on_throttle

    def _cool(self, now: float) -> None:
        self.state = BreakerState.COOLED
        self.cooled_until = max(self.cooled_until, now + self.period)

    def snapshot(self) -> AccountStatus:
        cooled = self.state is BreakerState.COOLED
        return AccountStatus(
            self.name,
            self.state,
            self.faults,
            self.cooled_until if cooled else None,
            self.period,
            self.probe_in_flight,
        )


class _Group:
    """Accounts of one priority serving one model, with its round-robin cursor."""

    __slots__ = ("cursor", "members")

    def __init__(self, members: tuple[_Breaker, ...]) -> None:
        self.members = members
        self.cursor = 0


class _Route:
    """Everything acquire() needs for one model, precomputed: groups in priority order."""

    __slots__ = ("breakers", "groups", "names")

    def __init__(self, breakers: Iterable[_Breaker]) -> None:
        # Stable sort: within a priority, config order sets the round-robin order.
        ordered = sorted(breakers, key=lambda b: b.spec.priority)
        self.breakers = tuple(ordered)
        self.names = tuple(b.name for b in ordered)
        groups: dict[int, list[_Breaker]] = {}
        for b in ordered:
            groups.setdefault(b.spec.priority, []).append(b)
        self.groups = tuple(_Group(tuple(g)) for g in groups.values())


class AccountPool:
    """Chooses accounts per attempt and tracks their health. Not thread-safe (see module doc)."""

    def __init__(self, accounts: Sequence[AccountSpec], *, clock: Clock = monotonic) -> None:
        self._clock = clock
        self._breakers: dict[str, _Breaker] = {}
        for spec in accounts:
            if spec.name in self._breakers:
                raise ValueError(f"duplicate account name {spec.name!r}")
            self._breakers[spec.name] = _Breaker(spec)
        # Only models some account names explicitly get their own cached route, so the cache is
        # bounded by the config, not by whatever model strings clients send. Every other model is
        # served by the "*" accounts alone, through one shared route.
        self._explicit = frozenset(m for s in accounts for m in s.models if m != "*")
        self._routes: dict[str, _Route] = {}
        wildcard = [b for b in self._breakers.values() if "*" in b.spec.models]
        self._wildcard: _Route | None = _Route(wildcard) if wildcard else None
        # The lease currently probing each account, to tell it apart from stale probe leases.
        self._probes: dict[str, Lease] = {}

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
    ) -> Lease | None:
        """The next account to try for ``model``, or None when none is eligible.

        Eligible: serves the model, not in ``exclude``, in ``allowed`` if given, and closed or
        due a probe (then the lease has ``probe=True`` and nobody else gets that account until
        the lease is recorded or released). Lowest priority value first; equal priorities take
        turns (round-robin per model and priority).
        """
        route = self._route(model)
        if route is None:
            return None
        now = self._clock()
        for group in route.groups:
            members = group.members
            n = len(members)
            idx = group.cursor
            for _ in range(n):
                b = members[idx]
                idx = idx + 1 if idx + 1 < n else 0
                if b.name in exclude or (allowed is not None and b.name not in allowed):
                    continue
                admit = b.admit(now)
                if admit is _Admit.DENY:
                    continue
                # Next caller starts after this account: even spreading within the group.
                group.cursor = idx
                if admit is _Admit.GRANT:
                    return Lease(b.name, False)
                lease = Lease(b.name, True)
                self._probes[b.name] = lease
                return lease
        return None

    def _take_probe(self, lease: Lease) -> bool:
        """Whether ``lease`` is the account's live probe; if so, it stops being one."""
        if lease.probe and self._probes.get(lease.account) is lease:
            del self._probes[lease.account]
            return True
        return False

    def record(self, lease: Lease, outcome: Outcome) -> None:
        """Feed back how the attempt under ``lease`` ended. Record each lease once."""
        b = self._breakers[lease.account]
        probe = self._take_probe(lease)
        if outcome is Outcome.FAULT:
            b.on_fault(self._clock(), probe)
        elif outcome is Outcome.SUCCESS:
            b.on_success(probe)
        else:
            b.on_throttle(probe)

    def release(self, lease: Lease) -> None:
        """The attempt ended without an outcome (e.g. client gone): free a probe slot only."""
        self._breakers[lease.account].on_release(self._take_probe(lease))

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
        best: float | None = None
        for b in route.breakers:
            if allowed is not None and b.name not in allowed:
                continue
            if b.state is BreakerState.CLOSED:
                return 0.0
            if b.probe_in_flight:
                wait = PROBE_RETRY_AFTER_SECS
            elif b.state is BreakerState.HALF_OPEN:
                return 0.0
            else:
                wait = max(0.0, b.cooled_until - now)
            if best is None or wait < best:
                best = wait
        return best

    def status(self) -> list[AccountStatus]:
        """Snapshot of every account, in config order."""
        return [b.snapshot() for b in self._breakers.values()]

    def status_of(self, name: str) -> AccountStatus:
        """Snapshot of one account; KeyError if unknown."""
        return self._breakers[name].snapshot()
