"""What switchyard answers itself, and what a response says about the decisions made for it:
the same statuses, error types, texts and headers through both fronts.

The error types of the answers switchyard makes when no upstream answer can be passed on:

    429 rate_limited          every account serving the model is held by a 429's retry time
                              (or held and cooling); `retry-after` says when the earliest is back
    503 no_healthy_account    every account serving the model is cooling; `retry-after` too,
                              except when every one cools for refused credentials (see
                              `nothing_serves`)
    502 upstream_unreachable  every attempt failed in transport and no upstream answer exists
    504 deadline_exceeded     the attempt (or the caller's budget) ran out of time; the text
                              names the phase
"""

from __future__ import annotations

import math

from ..context import RequestContext
from ..wire import WireError
from .provider_headers import UPSTREAM_REQUEST_ID

RATE_LIMITED = "rate_limited"
NO_HEALTHY_ACCOUNT = "no_healthy_account"
UPSTREAM_UNREACHABLE = "upstream_unreachable"
DEADLINE_EXCEEDED = "deadline_exceeded"

DEADLINE_TEXTS = {
    "total": "the upstream attempt did not finish within its deadline",
    "headers": "the upstream stream did not start within its deadline",
    "idle": "the upstream stream went silent for longer than its idle limit",
    "budget": "the request's overall time budget ran out",
    "first_token": "the upstream stream sent no content within its first-token limit",
    "slow": "the upstream stream's output rate stayed below its floor",
}
"""The 504's text for each deadline phase."""
_DEADLINES = {
    phase: WireError(504, DEADLINE_EXCEEDED, text) for phase, text in DEADLINE_TEXTS.items()
}
_UNREACHABLE = WireError(502, UPSTREAM_UNREACHABLE, "no upstream account could be reached")
Headers = tuple[tuple[bytes, bytes], ...]


def deadline_exceeded(phase: str) -> WireError:
    """The 504 for a deadline that expired in `phase` (total, headers, first_token,
    idle, slow or budget)."""
    return _DEADLINES[phase]


def unreachable() -> WireError:
    """The 502 when every attempt failed in transport and no upstream answered."""
    return _UNREACHABLE


REFUSED_RETRY_AFTER_MAX_SECS = 5
"""The longest `retry-after` an answer invites when every account cools for refused credentials:
a revoked key does not heal by waiting, so a client is only told to come back when the next
probe of one is that close (it tells whether a key works again)."""
_NO_RETRY = ((b"x-should-retry", b"false"),)
"""Read by the official OpenAI and Anthropic SDKs before their own retry rule: they raise at
once instead of retrying a 503 that no wait can cure."""


def nothing_serves(
    model: str | None,
    *,
    throttled: bool,
    heals_in_secs: float | None,
    refused_in_secs: float | None = None,
    refused_now: bool = False,
) -> tuple[WireError, Headers]:
    """The answer when no account can take the request now.

    `heals_in_secs`: the soonest an account that waiting can heal is back (a hold, an outage's
    cooling; None: there is none); `refused_in_secs`: the soonest probe of an account cooling for
    refused credentials (None: there is none). When some account can heal, it decides: 429 when
    the request waits on a throttle hold, else 503, `retry-after` = `heals_in_secs` in whole
    seconds, at least 1. When every account cools for refused credentials: 503 saying so, with
    `retry-after` only if the next probe is due within `REFUSED_RETRY_AFTER_MAX_SECS`, else
    `x-should-retry: false` and no `retry-after`. `refused_now`: some account refused its key
    or billing in this request (an account that is not cooling yet: its refusal invites no
    wait either).
    """
    if heals_in_secs is None and (refused_in_secs is not None or refused_now):
        return _refused(model, refused_in_secs)
    retry_after = _retry_after(1.0 if heals_in_secs is None else heals_in_secs)
    if throttled:
        text = f"every upstream account for model {model!r} is rate limited"
        return WireError(429, RATE_LIMITED, text), retry_after
    text = f"no healthy upstream account for model {model!r}"
    if refused_in_secs is not None or refused_now:
        text += "; the credentials of some were refused"
    return WireError(503, NO_HEALTHY_ACCOUNT, text), retry_after


def _refused(model: str | None, wait_secs: float | None) -> tuple[WireError, Headers]:
    text = (
        f"no healthy upstream account for model {model!r}: the upstream refused the credentials "
        "of every account (401, 402 or 403); retrying will not help until their keys or billing "
        "are fixed"
    )
    error = WireError(503, NO_HEALTHY_ACCOUNT, text)
    if wait_secs is None:  # refused in this request, none cooling: no probe to wait for
        return error, _NO_RETRY
    secs = _whole_secs(wait_secs)
    if secs <= REFUSED_RETRY_AFTER_MAX_SECS:
        return error, ((b"retry-after", str(secs).encode()),)
    return error, _NO_RETRY


def _retry_after(wait_secs: float) -> Headers:
    return ((b"retry-after", str(_whole_secs(wait_secs)).encode()),)


def _whole_secs(wait_secs: float) -> int:
    """A wait as `retry-after` gives it: whole seconds, rounded up, at least 1."""
    return max(1, math.ceil(wait_secs))


def exposed_headers(ctx: RequestContext) -> tuple[tuple[bytes, bytes], ...]:
    """The `x-switchyard-*` response headers that say what was decided.

    Nearly every response repeats one of a few decisions (model, account, attempts, deadline,
    route), so each distinct one is encoded once and shared. The deadline is keyed in whole ms,
    as the header shows it: one cut by a budget differs a little from request to request. The
    cache is bounded (a model name may be anything a client sends, a budget any number): when
    full, it starts over. The provider's request id (`x-switchyard-upstream-request-id`,
    `engine.provider_headers`) is each answer's own and follows the shared ones.
    """
    client = ctx.account
    deadline = ctx.attempt_deadline_secs
    decision = (
        ctx.resolved_model,
        None if client is None else client.name,
        ctx.attempts,
        None if deadline is None else round(deadline * 1000),
        ctx.route,
    )
    headers = _EXPOSED.get(decision)
    if headers is None:
        headers = _encode_exposed(*decision)
        if len(_EXPOSED) >= _EXPOSED_MAX:
            _EXPOSED.clear()
        _EXPOSED[decision] = headers
    upstream_id = ctx.upstream_request_id
    if upstream_id is not None:  # unique per answer: never cached
        return (*headers, (UPSTREAM_REQUEST_ID, upstream_id))
    return headers


def _encode_exposed(
    model: str | None,
    account: str | None,
    attempts: int,
    deadline_ms: int | None,
    route: str | None,
) -> tuple[tuple[bytes, bytes], ...]:
    out: list[tuple[bytes, bytes]] = []
    if model is not None:
        out.append((b"x-switchyard-model", model.encode()))
    if account is not None:
        out.append((b"x-switchyard-account", account.encode()))
    if attempts:
        out.append((b"x-switchyard-attempts", str(attempts).encode()))
    if deadline_ms is not None:
        out.append((b"x-switchyard-deadline-ms", str(deadline_ms).encode()))
    if route is not None:
        out.append((b"x-switchyard-route", route.encode()))
    return tuple(out)


_EXPOSED_MAX = 1024
_EXPOSED: dict[
    tuple[str | None, str | None, int, int | None, str | None], tuple[tuple[bytes, bytes], ...]
] = {}
