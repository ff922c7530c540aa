"""What the end of one upstream attempt tells the account pool, and the metrics that count it.

Shared by every transport that runs attempts (the ASGI cooling middleware, the ext_proc
servicer), so a fault is counted the same way whoever saw it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from ..core.pool import AccountPool, BreakerState, Lease, Outcome, fault_cause
from ..core.throttle import READ_HEADERS, retry_secs
from ..telemetry import names as tm

_FAULT = Outcome.FAULT  # read on every attempt; Enum member access is slow on Python 3.11
_COOLED = BreakerState.COOLED


def settle(pool: AccountPool, lease: Lease, outcome: Outcome | None, status: str) -> None:
    """Give `lease` back with its attempt's outcome (None: no outcome, just release it).

    A fault adds one to `switchyard.account.faults{switchyard.account, status}`, and one to
    `switchyard.account.cooled{switchyard.account}` when it is the fault that starts a cooling.
    """
    if outcome is None:
        pool.release(lease)
        return
    if outcome is not _FAULT:
        pool.record(lease, outcome)  # the hot path: no state snapshot, no metric
        return
    name = lease.account
    before = _cooled(pool, lease)
    pool.record(lease, outcome, fault_cause(status))
    tm.account_faults.add(1, {tm.ACCOUNT: name, "status": status})
    if _cooled(pool, lease) > before:
        tm.account_cooled.add(1, {tm.ACCOUNT: name})


def _cooled(pool: AccountPool, lease: Lease) -> int:
    """How many of the breakers `lease`'s outcome may land on are cooled: the account's own
    and, where it keeps model faults per model, that pair's."""
    cooled = pool.status_of(lease.account).state is BreakerState.COOLED
    if lease.model is None:
        return cooled
    return cooled + (pool.status_of(lease.account, model=lease.model).state is _COOLED)


def hold(pool: AccountPool, account: str, model: str, headers: Iterable[tuple[str, str]]) -> float:
    """Hold `account` out of rotation for `model` as long as its 429 asked (capped).

    `headers`: the 429's response headers, (lowercase name, value). Without a retry time
    nothing is held. A hold adds one to `switchyard.account.throttled{switchyard.account,
    gen_ai.response.model}`; the
    model label is "*" for a model no account names (a wildcard account serves any string a
    client sends, and a label must stay bounded). Returns the seconds held (0.0: none).
    """
    now = time.time()
    secs = retry_secs(headers, wall_now=now)
    if secs is None:
        return 0.0
    held = pool.hold(account, model, secs, wall_now=now)
    if held > 0:
        label = model if model in pool.named_models else "*"
        tm.account_throttled.add(1, {tm.ACCOUNT: account, tm.RESPONSE_MODEL: label})
    return held


def throttle_headers(raw: Iterable[tuple[bytes | str, bytes]]) -> list[tuple[str, str]]:
    """The headers of a 429 that say when to retry, decoded (the rest are not kept); names
    as ASGI gives them (bytes) or as the ext_proc front reads them (str)."""
    kept = []
    for name, value in raw:
        key = (name.decode("latin-1") if isinstance(name, bytes) else name).lower()
        if key in READ_HEADERS:
            kept.append((key, value.decode("latin-1")))
    return kept
