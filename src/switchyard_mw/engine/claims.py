"""The one await a request's attempts may need: claiming a probe in the shared state store.

The attempt machine and the account pool never wait; whoever drives them performs the claim
they ask for and reports the store's answer back. Both fronts drive the machine through
`claimed`; `acquire_shared` does the same for a pool used on its own.
"""

from __future__ import annotations

from collections.abc import Collection

from ..core.pool import AccountPool, Lease
from ..core.shared import Shared, StateStore
from .machine import AttemptMachine, ClaimProbe, Start


async def claimed(machine: AttemptMachine, action: Start) -> Start:
    """Perform `action` while it is `ClaimProbe`: the machine's next action after the store's
    answers. Cancelled or failed midway, the probe slot goes back."""
    while isinstance(action, ClaimProbe):
        store = machine.grounds.pool.store
        assert store is not None  # a probe is only claimed where state is shared
        try:
            shared = await _claim(store, action.account, action.model)
        except BaseException:
            machine.claim_abandoned()
            raise
        action = machine.probe_claimed(shared)
    return action


async def acquire_shared(
    pool: AccountPool,
    model: str,
    *,
    exclude: Collection[str] = (),
    allowed: Collection[str] | None = None,
) -> Lease | None:
    """`pool.acquire`, with a probe's slot claimed across replicas when state is shared.

    When the local choice is a probe, the attached store is asked for the shared slot; if
    another replica holds it (or the shared cooling lasts longer), that account is skipped and
    the next one chosen. Each refusal makes its account ineligible, so this ends within
    len(accounts) claims.
    """
    lease = pool.acquire(model, exclude=exclude, allowed=allowed)
    store = pool.store
    while store is not None and lease is not None and lease.probe:
        try:
            shared = await _claim(store, lease.account, lease.unit)
        except BaseException:
            pool.claim_abandoned(lease)
            raise
        if shared is None:
            return lease
        pool.claim_refused(lease, shared)
        lease = pool.acquire(model, exclude=exclude, allowed=allowed)
    return lease


async def _claim(store: StateStore, account: str, model: str | None) -> Shared | None:
    """The store's claim of an account's probe slot, or (`model`) of that pair's."""
    if model is None:
        return await store.claim_probe(account)
    return await store.claim_probe(account, model)
