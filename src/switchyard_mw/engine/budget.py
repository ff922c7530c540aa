"""The request's overall budget from its headers, read the same way by every transport."""

from __future__ import annotations

from collections.abc import Callable

from ..core.deadline_math import BUDGET_HEADERS, parse_budget_ms
from ..telemetry import names as tm


def budget_end(header: Callable[[bytes], bytes | None], started_at: float) -> float | None:
    """When the caller's budget ends (monotonic time): the shortest valid budget header wins.

    `header(name)` returns a request header's value or None. An invalid value is ignored and
    counted in `switchyard.budget.invalid`: a budget header may only shorten, never fail.
    """
    budgets = []
    for name in BUDGET_HEADERS:
        value = header(name)
        if value is None:
            continue
        secs = parse_budget_ms(value)
        if secs is None:
            tm.budget_invalid.add(1, {"header": name.decode()})
        else:
            budgets.append(secs)
    return started_at + min(budgets) if budgets else None
