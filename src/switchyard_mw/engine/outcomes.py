"""What the end of one upstream attempt tells the account pool, and the metrics that count it.

Shared by every transport that runs attempts (the ASGI cooling middleware, the ext_proc
servicer), so a fault is counted the same way whoever saw it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from ..core.pool import AccountPool, BreakerState, Lease, Outcome, fault_cause
from ..core.throttle import READ_HEADERS, retry_secs
from ..telemetry import logs
from ..telemetry import names as tm

_FAULT = Outcome.FAULT  # read on every attempt; Enum member access is slow on Python 3.11
_SUCCESS = Outcome.SUCCESS
_COOLED = BreakerState.COOLED


def settle(pool: AccountPool, lease: Lease, outcome: Outcome | None, status: str) -> None:
    """Give `lease` back with its attempt's outcome (None: no outcome, just release it).

    A fault adds one to `switchyard.account.faults{switchyard.account, status}`, and one to
    `switchyard.account.cooled{switchyard.account}` when it is the fault that starts a cooling
    (and logs it); a probe's end is logged (`switchyard_mw.telemetry.logs`).
    """
    if outcome is None:
        pool.release(lease)
        return
    if outcome is not _FAULT:
        pool.record(lease, outcome)  # the hot path: no state snapshot, no metric
        if lease.probe:
            probed(pool, lease, outcome, status)
        return
    name = lease.account
    before = _cooled(pool, lease)
    cause = fault_cause(status)
    pool.record(lease, outcome, cause)
    tm.account_faults.add(1, {tm.ACCOUNT: name, "status": status})
    after = _cooled(pool, lease)
    if after != before and any(after):
        tm.account_cooled.add(1, {tm.ACCOUNT: name})
        # The account's own breaker when it cooled, else the (account, model) pair's.
        model = None if after[0] and not before[0] else lease.model
        period = pool.status_of(name, model=model).current_cooldown_secs
        logs.account_cooled(
            account=name,
            model=model,
            cause=cause.value,
            period_secs=period,
            status=status,
            probe=lease.probe,
        )


def probed(pool: AccountPool, lease: Lease, outcome: Outcome, status: str) -> None:
    """Log how a probe that was no fault ended: a success closes what it probed (back in
    rotation), a throttle leaves it half-open. Only probe leases come here: rare."""
    model = lease.unit
    if outcome is _SUCCESS:
        if pool.status_of(lease.account, model=model).state is BreakerState.CLOSED:
            logs.account_recovered(account=lease.account, model=model)
        return
    logs.probe_inconclusive(account=lease.account, model=model, status=status)


def _cooled(pool: AccountPool, lease: Lease) -> tuple[bool, bool]:
    """Whether each of the breakers `lease`'s outcome may land on is cooled: the account's own
    and, where it keeps model faults per model, that pair's (False where it keeps none)."""
    cooled = pool.status_of(lease.account).state is _COOLED
    if lease.model is None:
        return cooled, False
    return cooled, pool.status_of(lease.account, model=lease.model).state is _COOLED


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
        logs.throttle_hold(account=account, model=model, hold_secs=held)
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
