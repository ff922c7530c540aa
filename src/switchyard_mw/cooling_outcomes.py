"""What the end of one upstream attempt tells the account pool, and the metrics that count it.

Shared by every transport that runs attempts (the ASGI cooling middleware, the ext_proc
servicer), so a fault is counted the same way whoever saw it.
"""

from __future__ import annotations

from . import telemetry as tm
from .core.pool import AccountPool, BreakerState, Lease, Outcome, classify_status

_FAULT = Outcome.FAULT  # read on every attempt; Enum member access is slow on Python 3.11


def outcome_of(status: int) -> tuple[Outcome, str]:
    """An upstream status as an outcome, and as the `status` text metrics show."""
    return classify_status(status), str(status)


def settle(pool: AccountPool, lease: Lease, outcome: Outcome | None, status: str) -> None:
    """Give `lease` back with its attempt's outcome (None: no outcome, just release it).

    A fault adds one to `switchyard.account.faults{account, status}`, and one to
    `switchyard.account.cooled{account}` when it is the fault that starts a cooling.
    """
    if outcome is None:
        pool.release(lease)
        return
    if outcome is not _FAULT:
        pool.record(lease, outcome)  # the hot path: no state snapshot, no metric
        return
    name = lease.account
    before = pool.status_of(name).state
    pool.record(lease, outcome)
    tm.account_faults.add(1, {"account": name, "status": status})
    if before is not BreakerState.COOLED and pool.status_of(name).state is BreakerState.COOLED:
        tm.account_cooled.add(1, {"account": name})
