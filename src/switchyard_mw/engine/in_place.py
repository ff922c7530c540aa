"""Retry in place: how long to wait before sending a request again to the account that just
refused it, when no other account can take it (sans-IO).

Opt-in per account (`retry_wait_max_secs`, 0 = off). Two answers qualify:
- a 429 whose retry time (`core.throttle.retry_secs`: `retry-after-ms`, `retry-after`, an
  exhausted limit's reset) is at most `retry_wait_max_secs`; a 429 that says no time is not
  retried in place (nothing says waiting would help);
- a 5xx (an account fault other than a deadline): its own retry time if it gives one (at most
  `retry_wait_max_secs`), else `FAULT_WAIT_SECS`.
The attempt machine asks this once no other account of the model can take the request, before
any model of a fallback chain (a short wait on the model the client asked for beats another
model), at most once a request, never after a refused key or billing, and only while the wait
ends inside the caller's budget.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from ..core.pool import Outcome
from ..core.throttle import retry_secs
from .attempts import outcome

FAULT_WAIT_SECS = 0.5
"""The wait before retrying a 5xx that gave no retry time: the official OpenAI and Anthropic
SDKs' first back-off. Never zero: a retry in place is never a tight loop."""
MIN_WAIT_SECS = 0.05
"""The shortest wait: a 429 that says `retry-after: 0` still gets a breath."""


def wait_secs(
    status: int | None,
    headers: Sequence[tuple[str, str]] | None,
    *,
    max_secs: float,
    deadline_phase: str | None = None,
    upstream_status: int | None = None,
    wall_now: float | None = None,
) -> float | None:
    """Seconds to wait before retrying an answer with `status` on its own account (its
    `headers`: the retry-time headers kept of it), or None when it is not to be retried in
    place. `max_secs`: the account's `retry_wait_max_secs`."""
    if not max_secs > 0 or status is None:
        return None
    found, _ = outcome(status, deadline_phase=deadline_phase, upstream_status=upstream_status)
    if found is Outcome.SUCCESS or deadline_phase is not None:
        return None
    fault = found is Outcome.FAULT and status >= 500
    if found is not Outcome.THROTTLE and not fault:
        return None  # a refused credential or billing does not heal by waiting
    said = retry_secs(headers or (), wall_now=time.time() if wall_now is None else wall_now)
    if said is None:
        if not fault:
            return None
        said = min(FAULT_WAIT_SECS, max_secs)
    if said > max_secs:
        return None
    return max(said, MIN_WAIT_SECS)
