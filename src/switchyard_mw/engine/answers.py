"""What switchyard answers itself, and what a response says about the decisions made for it:
the same statuses, error types, texts and headers through both fronts.

The error types of the answers switchyard makes when no upstream answer can be passed on:

    429 rate_limited          every account serving the model is held by a 429's retry time
                              (or held and cooling); `retry-after` says when the earliest is back
    503 no_healthy_account    every account serving the model is cooling; `retry-after` too
    502 upstream_unreachable  every attempt failed in transport and no upstream answer exists
    504 deadline_exceeded     the attempt (or the caller's budget) ran out of time; the text
                              names the phase
"""

from __future__ import annotations

import math

from ..context import RequestContext
from ..wire import WireError

RATE_LIMITED = "rate_limited"
NO_HEALTHY_ACCOUNT = "no_healthy_account"
UPSTREAM_UNREACHABLE = "upstream_unreachable"
DEADLINE_EXCEEDED = "deadline_exceeded"

DEADLINE_TEXTS = {
    "total": "the upstream attempt did not finish within its deadline",
    "headers": "the upstream stream did not start within its deadline",
    "idle": "the upstream stream went silent for longer than its idle limit",
    "budget": "the request's overall time budget ran out",
}
"""The 504's text for each deadline phase."""
_DEADLINES = {
    phase: WireError(504, DEADLINE_EXCEEDED, text) for phase, text in DEADLINE_TEXTS.items()
}
_UNREACHABLE = WireError(502, UPSTREAM_UNREACHABLE, "no upstream account could be reached")
Headers = tuple[tuple[bytes, bytes], ...]


def deadline_exceeded(phase: str) -> WireError:
    """The 504 for a deadline that expired in `phase` (total, headers, idle or budget)."""
    return _DEADLINES[phase]


def unreachable() -> WireError:
    """The 502 when every attempt failed in transport and no upstream answered."""
    return _UNREACHABLE


def nothing_serves(
    model: str | None, *, throttled: bool, wait_secs: float
) -> tuple[WireError, Headers]:
    """The answer when no account can take the request now: 429 when it waits on a throttle
    hold, else 503; `retry-after` is `wait_secs` in whole seconds, at least 1."""
    retry_after = ((b"retry-after", str(max(1, math.ceil(wait_secs))).encode()),)
    if throttled:
        text = f"every upstream account for model {model!r} is rate limited"
        return WireError(429, RATE_LIMITED, text), retry_after
    text = f"no healthy upstream account for model {model!r}"
    return WireError(503, NO_HEALTHY_ACCOUNT, text), retry_after


def exposed_headers(ctx: RequestContext) -> tuple[tuple[bytes, bytes], ...]:
    """The `x-switchyard-*` response headers that say what was decided.

    Nearly every response repeats one of a few decisions (model, account, attempts, deadline,
    route), so each distinct one is encoded once and shared; the cache is bounded, since a
    model name may be anything a client sends.
    """
    client = ctx.account
    decision = (
        ctx.resolved_model,
        None if client is None else client.name,
        ctx.attempts,
        ctx.attempt_deadline_secs,
        ctx.route,
    )
    headers = _EXPOSED.get(decision)
    if headers is None:
        headers = _encode_exposed(*decision)
        if len(_EXPOSED) < 1024:
            _EXPOSED[decision] = headers
    return headers


def _encode_exposed(
    model: str | None, account: str | None, attempts: int, deadline: float | None, route: str | None
) -> tuple[tuple[bytes, bytes], ...]:
    out: list[tuple[bytes, bytes]] = []
    if model is not None:
        out.append((b"x-switchyard-model", model.encode()))
    if account is not None:
        out.append((b"x-switchyard-account", account.encode()))
    if attempts:
        out.append((b"x-switchyard-attempts", str(attempts).encode()))
    if deadline is not None:
        out.append((b"x-switchyard-deadline-ms", str(round(deadline * 1000)).encode()))
    if route is not None:
        out.append((b"x-switchyard-route", route.encode()))
    return tuple(out)


_EXPOSED: dict[
    tuple[str | None, str | None, int, float | None, str | None], tuple[tuple[bytes, bytes], ...]
] = {}
