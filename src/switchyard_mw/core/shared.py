"""What the account pool and a shared state store tell each other (sans-IO: types only).

The pool stays the local view every decision is made from. A store (``switchyard_mw.state``)
hears about the transitions that change an account's health — never about a success on a
healthy account, so the hot path makes no round trip — and feeds back what other replicas did,
as :class:`Shared` snapshots that the pool merges (a cooling end only ever moves later).

The one place a decision has to wait for the store is the half-open probe: every replica may see
the cooling end at the same moment, and only one of them may send the probe.
The pool never waits for it: whoever drives an attempt awaits :meth:`StateStore.claim_probe`
and hands the answer back (:meth:`~switchyard_mw.core.pool.AccountPool.claim_refused`).
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol


class Cause(enum.Enum):
    """Why an account last faulted, and so why it cools: whether waiting can heal it."""

    OUTAGE = "outage"
    """5xx, an attempt deadline, a reset or refused connection: the provider may come back."""
    CREDENTIALS = "credentials"
    """401, 402 or 403: the key or its billing was refused; it does not heal by waiting."""


class Change(enum.Enum):
    """A transition of one account that other replicas must hear about."""

    FAULT = "fault"
    """A fault counted while the account was closed (it may have cooled it)."""
    PROBE_FAULT = "probe_fault"
    """The probe faulted: the account cools again with the doubled period."""
    RESET = "reset"
    """A success after faults: the consecutive count is back to 0."""
    PROBE_SUCCESS = "probe_success"
    """The probe succeeded: the account is closed again."""
    PROBE_FREED = "probe_freed"
    """The probe ended without a verdict (a 429, the client left): the slot is free."""


@dataclass(frozen=True, slots=True)
class Shared:
    """One account's state as a store reports it, in seconds from the moment it was read.

    ``cooled_for_secs``: None when no cooling is in force, else the seconds until the probe is
    due (<= 0: due now). ``closed``: a probe succeeded somewhere, so the account is closed
    whatever this replica believed. ``probe_for_secs``: None when unknown, 0 when no replica
    holds the probe slot, else the longest the current holder may keep it. ``cause``: why the
    account last faulted (while cooled: why it cools).
    """

    faults: int
    period_secs: float
    cooled_for_secs: float | None = None
    closed: bool = False
    probe_for_secs: float | None = None
    cause: Cause = Cause.OUTAGE


class TripBoard(Protocol):
    """Canary guard trips a store shares between replicas (the engine's `Canaries`)."""

    on_trip: Callable[[str, str], None] | None
    """Told of each trip made here (base model, variant), to send it to the others."""

    def trip(self, base: str, variant: str, *, announce: bool = True) -> None:
        """Take `variant` of `base`'s canary out; `announce=False` when a replica told us."""

    def signature(self, base: str) -> str:
        """`base`'s canary as configured, as a digest ("" if none): a trip applies only to a
        canary configured as the one that tripped."""
        ...


class StateStore(Protocol):
    """What an :class:`~switchyard_mw.core.pool.AccountPool` needs from a shared store.

    Neither method may raise or wait long: a store that cannot reach its backend answers from
    nothing (``claim_probe`` returns None, so the local decision stands) and catches up later.
    """

    def changed(
        self, account: str, change: Change, local: Shared, *, model: str | None = None
    ) -> None:
        """Hear about a transition; ``local`` is the pool's view right after it. Never blocks:
        the write happens in the background. ``model``: the transition is that (account,
        model) pair's (a model fault of an account serving several), not the account's."""

    def held(self, account: str, model: str, until_unix: float) -> None:
        """Hear about a throttle hold of ``account`` for ``model`` until ``until_unix`` (Unix
        time: replicas share no monotonic clock). Never blocks: sent in the background."""

    def claim_probe(self, account: str, model: str | None = None) -> Awaitable[Shared | None]:
        """Claim the single probe slot of ``account`` (with ``model``: of that pair) across
        replicas.

        None: the probe is this replica's to send. Otherwise the shared state that says why
        not (another replica holds the slot, or the cooling lasts longer than this replica
        knew); the pool merges it and moves on to another account.
        """
        ...
