"""Tenants on the ASGI front: `engine.tenancy` decides, this module only translates (request
headers in, ASGI messages out)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from ..context import TENANT_KEY, RequestContext
from ..engine.tenancy import Admission, Refusal, Tenancy
from ..wire import Wire
from ._types import Scope, Send
from .exchange import send_error

_pending: set[asyncio.Task[object]] = set()
"""Settles of requests whose task was cancelled (the client left): run to their end."""


_KEY_HEADERS = (b"x-api-key", b"authorization")


def _headers(scope: Scope, tenant_header: bytes | None) -> dict[str, str]:
    """The request headers identification reads (the first of each), in one pass."""
    wanted = _KEY_HEADERS if tenant_header is None else (*_KEY_HEADERS, tenant_header)
    found: dict[str, str] = {}
    for key, value in scope.get("headers", ()):
        if key in wanted:
            found.setdefault(key.decode("latin-1"), value.decode("latin-1"))
    return found


def identified(tenancy: Tenancy, ctx: RequestContext, scope: Scope) -> Refusal | None:
    """The tenant of the request on `ctx` (its refusal, 401 or 403, otherwise)."""
    state = scope.get("state") or {}
    header = tenancy.tenant_header
    sent = _headers(scope, None if header is None else header.encode("latin-1"))
    return tenancy.check(ctx, named=state.get(TENANT_KEY), header=sent.get)


def unread_identified(tenancy: Tenancy, ctx: RequestContext, scope: Scope) -> Refusal | None:
    """The tenant of an LLM call whose body is not read, on `ctx`; its 401 otherwise."""
    state = scope.get("state") or {}
    header = tenancy.tenant_header
    sent = _headers(scope, None if header is None else header.encode("latin-1"))
    who = tenancy.identify(named=state.get(TENANT_KEY), header=sent.get)
    if isinstance(who, Refusal):
        return who
    ctx.tenant = who
    return None


async def refuse(out: Send, wire: Wire, refusal: Refusal) -> None:
    """The refusal as the wire's error answer (`out`: the exchange's, when there is one)."""
    error = refusal.error
    await send_error(out, wire, error.status, error.error_type, error.message, refusal.headers)


async def settled(
    tenancy: Tenancy, admission: Admission, ctx: RequestContext, run: Awaitable[None]
) -> None:
    """Run the request's attempts, then settle, keep or release its reservation."""
    try:
        await run
    except asyncio.CancelledError:
        # The client left: the settle still runs, in a task of its own, since this one is
        # cancelled (a shared store's settle may await).
        task = asyncio.get_running_loop().create_task(_finish(tenancy, admission, ctx))
        _pending.add(task)
        task.add_done_callback(_pending.discard)
        raise
    except BaseException:
        await _finish(tenancy, admission, ctx)
        raise
    await _finish(tenancy, admission, ctx)


async def _finish(tenancy: Tenancy, admission: Admission, ctx: RequestContext) -> object:
    status = ctx.response_status
    # An answer started: a success reached the client from the app (an upstream's answer).
    answered = status is not None and status < 400 and ctx.attempts > 0
    return await tenancy.end_request(admission, ctx, answered=answered)
