"""The one place outbound HTTP clients are built, so their transport can change in one place.

Used by the judge and by the example gateway; a team's own app gets the deadline for its
upstream call in one line: `client.post(..., timeout=timeout_for(current_context()))`.
"""

from __future__ import annotations

import httpx

from .context import RequestContext

DEFAULT_MAX_CONNECTIONS = 256


def make_http_client(
    *, max_connections: int = DEFAULT_MAX_CONNECTIONS, base_url: str = ""
) -> httpx.AsyncClient:
    """A pooled async client for upstream calls; build one per process and reuse it.

    No timeout of its own: each call passes the deadline of its request (`timeout_for`).
    """
    limits = httpx.Limits(
        max_connections=max_connections, max_keepalive_connections=max_connections
    )
    return httpx.AsyncClient(base_url=base_url, limits=limits, timeout=None, trust_env=False)


def timeout_for(ctx: RequestContext | None, *, default_secs: float = 60.0) -> httpx.Timeout:
    """An httpx timeout bounded by what is left of the request's attempt deadline and budget.

    httpx applies it per operation (connect, each read); the deadline middleware bounds the
    attempt as a whole, so a trickling upstream cannot stretch it.
    """
    remaining = ctx.deadline if ctx is not None else None
    return httpx.Timeout(default_secs if remaining is None else max(remaining, 0.001))
