"""One account's circuit breaker: its config, states and transitions (sans-IO).

Internal to :mod:`switchyard_mw.core`; the public names are re-exported by
:mod:`switchyard_mw.core.pool`. Kept apart from the selection logic so that the state machine,
including how it merges what other replicas report (:meth:`Breaker.merge`), reads on one page.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from switchyard_mw.core.shared import Cause, Shared


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
    max_throttle_secs: float = 60.0
    """The longest a 429's retry time may keep this account out of rotation for a model."""
    weight: float = 1.0
    """Its share of conversations among the accounts of its priority (rendezvous weight)."""

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
        if not self.max_throttle_secs > 0:
            raise ValueError(f"account {self.name!r}: max_throttle_secs must be > 0")
        if not (self.weight > 0 and math.isfinite(self.weight)):
            raise ValueError(f"account {self.name!r}: weight must be > 0 and finite")

    def serves(self, model: str) -> bool:
        """Whether this account may be used for ``model``."""
        return "*" in self.models or model in self.models


class BreakerState(enum.Enum):
    """A breaker's state. As reported (:meth:`Breaker.state_at`): ``COOLED`` only while the
    cooling period runs; ``HALF_OPEN`` from its end until a probe closes or re-cools it.

    The field :attr:`Breaker.state` moves on events alone: it stays ``COOLED`` after the period
    has run out until :meth:`Breaker.admit` lets a probe go, and reads the clock nowhere.
    """

    CLOSED = "closed"
    COOLED = "cooled"
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class AccountStatus:
    """Snapshot of one account for operators; ``cooled_until`` is clock time (s) while the
    cooling period runs (``state`` COOLED), else None.

    ``probe_in_flight`` counts a probe sent by another replica too (shared state); ``cause``:
    why it is out of rotation (cooled or half-open), None while closed. ``probe_due``:
    half-open with no probe out, so the next attempt on it is the probe.
    """

    name: str
    state: BreakerState
    consecutive_faults: int
    cooled_until: float | None
    current_cooldown_secs: float
    probe_in_flight: bool
    cause: Cause | None = None
    probe_due: bool = False


class Admit(enum.Enum):
    """Answer of :meth:`Breaker.admit`."""

    DENY = 0
    GRANT = 1
    PROBE = 2


# The members every attempt reads, as module constants: on Python 3.11 `Admit.GRANT` costs
# about 150 ns more than a global (EnumType defines `__getattr__`, which puts every class
# attribute lookup on a slow path), and the acquire/record path reads several per request.
_CLOSED = BreakerState.CLOSED
_COOLED, _HALF_OPEN = BreakerState.COOLED, BreakerState.HALF_OPEN
_GRANT = Admit.GRANT


class Breaker:
    """One account's breaker state and transitions; the only mutable per-account state."""

    __slots__ = (
        "cause",
        "cooled_until",
        "faults",
        "name",
        "period",
        "probe_elsewhere_until",
        "probe_in_flight",
        "since",
        "spec",
        "state",
    )

    def __init__(self, spec: AccountSpec) -> None:
        self.spec = spec
        self.name = spec.name
        self.state = BreakerState.CLOSED
        self.faults = 0
        # Why it last faulted: while it cools, the cause of the fault that cooled it.
        self.cause = Cause.OUTAGE
        # -inf so `max()` keeps cooling end monotonic from the first cooling on.
        self.cooled_until = -math.inf
        self.period = spec.cooldown_secs
        self.probe_in_flight = False
        # Until when another replica holds the probe slot (shared state only).
        self.probe_elsewhere_until = -math.inf
        # When the cooling in force began after a closed spell (inf: closed): how old the
        # outage is, which decides whether a failed probe grows the period (`_grows`).
        self.since = math.inf

    def respec(self, spec: AccountSpec) -> None:
        """Take a reloaded config's settings for this account, keeping its state.

        A cooling in force runs to its end; the next period follows the new bounds.
        """
        self.spec = spec
        if self.state is _CLOSED:
            self.period = spec.cooldown_secs
        else:
            self.period = min(max(self.period, spec.cooldown_secs), spec.max_cooldown_secs)

    def admit(self, now: float) -> Admit:
        """Whether an attempt may start at ``now``; PROBE claims the single probe slot."""
        if self.state is _CLOSED:
            return _GRANT
        if (
            self.probe_in_flight
            or now < self.probe_elsewhere_until
            or self.state_at(now) is _COOLED
        ):
            return Admit.DENY
        self.state = BreakerState.HALF_OPEN
        self.probe_in_flight = True
        return Admit.PROBE

    def on_fault(self, now: float, probe: bool, cause: Cause = Cause.OUTAGE) -> None:
        self.faults += 1
        if probe:
            self.probe_in_flight = False
            if self._grows(now, cause):
                self.period = min(self.period * 2, self.spec.max_cooldown_secs)
            self.cause = cause
            self._cool(now, now + self.period)
        elif self.state is BreakerState.CLOSED:
            self.cause = cause
            if self.faults >= self.spec.failure_threshold:
                self._cool(now, now + self.period)
        # Otherwise a straggler acquired before the cooling: the account is already being dealt
        # with, so it must neither restart the cooling, nor double the period, nor change why.

    def _grows(self, now: float, cause: Cause) -> bool:
        """Whether a failed probe at `now` doubles the period (else it re-cools for the same).

        An outage younger than `max_cooldown_secs` keeps the period: most outages are short,
        and a provider that healed is then back within one period (plus the wait for the next
        request), not after a doubled one. Past that age it doubles as before, so an account
        that stays broken reaches the same steady probe rate. A credential refusal does not
        heal by waiting: it doubles from its first failed probe.
        """
        if cause is Cause.CREDENTIALS:
            return True
        return not now - self.since < self.spec.max_cooldown_secs

    def on_success(self, probe: bool) -> None:
        self.faults = 0
        if probe:
            self.probe_in_flight = False
            self.state = BreakerState.CLOSED
            self.period = self.spec.cooldown_secs
            self.since = math.inf

    def on_throttle(self, probe: bool) -> None:
        # A 429 says nothing about the account's health (nor does a release, which shares this):
        # free the slot so the next caller probes, stay half-open.
        if probe:
            self.probe_in_flight = False

    def on_release(self, probe: bool) -> None:
        self.on_throttle(probe)

    def _cool(self, now: float, until: float) -> None:
        if self.state is _CLOSED:
            self.since = now  # an outage begins
        self.state = BreakerState.COOLED
        self.cooled_until = max(self.cooled_until, until)

    def merge(self, now: float, shared: Shared) -> None:
        """Take in what the shared store says; a cooling end never moves earlier.

        Only a probe success (``closed``) ends a cooling early. A cooling reported while this
        replica's own probe is out is left to that probe's outcome.
        """
        if shared.probe_for_secs is not None:
            self.probe_elsewhere_until = (
                now + shared.probe_for_secs if shared.probe_for_secs > 0 else -math.inf
            )
        if shared.closed:
            self.state = BreakerState.CLOSED
            self.faults = shared.faults
            self.period = shared.period_secs
            self.since = math.inf
            return
        self.faults = shared.faults
        self.period = max(self.period, shared.period_secs)
        left = shared.cooled_for_secs
        if left is None:
            return
        if self.state is BreakerState.HALF_OPEN and (self.probe_in_flight or left <= 0):
            return  # our probe decides, or the cooling reported is the one already over
        if self.state is _CLOSED or now + left >= self.cooled_until:
            self.cause = shared.cause  # the cooling that ends last says why it cools
        self._cool(now, now + left)

    def view(self, now: float) -> Shared:
        """This breaker as a :class:`Shared` snapshot (what a store pushes after an outage)."""
        left = None if self.state is BreakerState.CLOSED else self.cooled_until - now
        if left is not None and not math.isfinite(left):
            left = 0.0
        return Shared(self.faults, self.period, left, cause=self.cause)

    def state_at(self, now: float) -> BreakerState:
        """The state at `now` as operators and metrics see it: a cooling whose period has run
        out is half-open (its probe is due) whether or not a request has come since."""
        if self.state is _COOLED and now >= self.cooled_until:
            return _HALF_OPEN  # from this instant `admit` lets the probe go
        return self.state

    def snapshot(self, now: float) -> AccountStatus:
        # `state_at`'s test, inline: a fault's settle reads snapshots around its record, and
        # the failover path's calls are counted (tests/asgi/test_call_budget.py).
        state = self.state
        if state is _COOLED and now >= self.cooled_until:
            state = _HALF_OPEN
        probing = self.probe_in_flight or now < self.probe_elsewhere_until
        return AccountStatus(
            self.name,
            state,
            self.faults,
            self.cooled_until if state is _COOLED else None,
            self.period,
            probing,
            None if state is _CLOSED else self.cause,
            state is _HALF_OPEN and not probing,
        )
