"""What a response says about the decisions made for it, the same through both fronts."""

from __future__ import annotations

from ..context import RequestContext


def exposed_headers(ctx: RequestContext) -> tuple[tuple[bytes, bytes], ...]:
    """The `x-switchyard-*` response headers that say what was decided.

    Nearly every response repeats one of a few decisions (model, account, attempts, deadline,
    route), so each distinct one is encoded once and shared; the cache is bounded, since a
    model name may be anything a client sends.
    """
    client = ctx.client
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
