"""What an attempt machine records as it decides: spans, metrics and decision logs.

The machine decides; this writes down what it decided, so that the machine holds no tracer,
meter or logger of its own. One `Recorder` is built per engine (with the accounts' providers
parsed once). Its span methods are asked only for a traced request (the machine holds no span
otherwise): an untraced request's success path calls nothing here. Its counters and logs
record the moves that are not the usual answer (a failover, a fallback, a deadline, a hedge).
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import trace

from ..accounts import Account
from ..context import RequestContext
from ..core.pool import Lease, Outcome
from ..telemetry import logs
from ..telemetry import names as tm
from . import attempts

FALLBACK_ROUTE = "fallback:"
"""`x-switchyard-route` of a request a fallback chain moved: `fallback:<reason>`."""


class Recorder:
    """The spans, counters and logs of one engine's attempts."""

    __slots__ = ("_providers",)

    def __init__(self, accounts: Mapping[str, Account]) -> None:
        # Read when an attempt's span starts: parsed once here, not per request.
        self._providers = {n: tm.provider_name(c.base_url) for n, c in accounts.items()}

    # --- spans (traced requests only) ---------------------------------------------------

    def attempt(
        self,
        ctx: RequestContext,
        lease: Lease,
        model: str,
        base_url: str,
        parent: trace.Span | None,
        *,
        hedge: bool = False,
    ) -> tuple[trace.Span, trace.Span]:
        """The attempt span (under the current span or `parent`, the request's) and its
        GenAI CLIENT span, for an attempt on `lease` to `model` at `base_url`."""
        context = None if parent is None else trace.set_span_in_context(parent)
        provider = self._providers.get(lease.account)
        span = attempts.start_span(lease, ctx.resolved_model, provider, context)
        if hedge:
            span.set_attribute(tm.HEDGE, True)
        elif ctx.route is not None and ctx.route.startswith(FALLBACK_ROUTE):
            span.set_attribute(tm.FALLBACK, ctx.route.removeprefix(FALLBACK_ROUTE))
        view = ctx.view
        client = tm.start_client_span(
            span,
            model=model,
            base_url=base_url,
            max_tokens=None if view is None else view.max_tokens,
        )
        return span, client

    @staticmethod
    def raised(span: trace.Span, error: type[BaseException]) -> None:
        # The type only: an exception's text may quote the request or the reply.
        span.set_attribute(tm.ERROR_TYPE, error.__qualname__)

    @staticmethod
    def resumed(span: trace.Span, broken: str, reason: str, after_bytes: int) -> None:
        span.set_attributes(
            {tm.RESUMED_FROM: broken, tm.RESUME_REASON: reason, tm.RESUMED_AFTER: after_bytes}
        )

    @staticmethod
    def settled(span: trace.Span, outcome: Outcome | None, status: str) -> None:
        """What the attempt's end said about its account, on its span."""
        attempts.mark_span(span, outcome, status)

    @staticmethod
    def ended(
        span: trace.Span | None,
        client_span: trace.Span | None,
        ctx: RequestContext,
        status: int | None,
        failure: str | None,
    ) -> None:
        """End an attempt's spans; the CLIENT span carries the usage read."""
        if client_span is not None:
            attempts.end_client_span(client_span, ctx, status=status, failure=failure)
        if span is not None:
            attempts.end_span(span, ctx.deadline_phase)

    @staticmethod
    def lost(
        span: trace.Span | None, client_span: trace.Span | None, model: str | None, status: str
    ) -> None:
        """End the spans of a race's loser (or a first attempt a hedge replaced)."""
        if client_span is not None:
            tm.end_client_span(
                client_span,
                model=model,
                error=status,
                input_tokens=None,
                output_tokens=None,
                cache_read_tokens=None,
                cache_write_tokens=None,
            )
        if span is not None:
            attempts.end_span(span, None)

    # --- counters and logs --------------------------------------------------------------

    @staticmethod
    def failover(model: str) -> None:
        tm.failovers.add(1, {tm.RESPONSE_MODEL: model})

    @staticmethod
    def fallback(from_model: str, to_model: str, reason: str) -> None:
        tm.fallbacks.add(
            1, {tm.REQUEST_MODEL: from_model, tm.RESPONSE_MODEL: to_model, "reason": reason}
        )
        logs.fallback(from_model=from_model, to_model=to_model, reason=reason)

    @staticmethod
    def deadline_exceeded(phase: str) -> None:
        tm.deadline_exceeded.add(1, {"phase": phase})

    @staticmethod
    def hedge_result(model: str, won: bool, account: str) -> None:
        result = "won" if won else "lost"
        tm.hedges.add(1, {tm.RESPONSE_MODEL: model, "result": result})
        logs.hedge_result(model=model, result=result, account=account)
