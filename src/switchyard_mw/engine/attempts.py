"""One upstream attempt, from plain facts: its deadline, what its end means, its span.

Each front hands in what it saw (the status, the deadline phase, the error kind, whether the
whole response reached the client); nothing here reads an ASGI message or an ext_proc phase.
"""

from __future__ import annotations

import enum
import time
from typing import Protocol

import httpx
from opentelemetry import trace
from opentelemetry.context import Context

from ..context import RequestContext
from ..core.deadline_math import attempt_deadline_secs
from ..core.pool import Lease, Outcome, classify_status
from ..telemetry import names as tm
from ..wire import RequestView
from .stream_bounds import first_token_secs


class Failure(enum.StrEnum):
    """How an attempt failed without an upstream answer to pass on, as metrics show it."""

    CONNECT_ERROR = "connect_error"
    TIMEOUT = "timeout"
    """The outbound call's own timeout (the deadline policy's is `DEADLINE`)."""
    TRANSPORT_ERROR = "transport_error"
    DEADLINE = "deadline"
    """A deadline phase that is the account's fault ran out (`ACCOUNT_PHASES`)."""
    NO_RESPONSE = "no_response"
    """The attempt ended without starting a response."""
    APP_ERROR = "app_error"
    """An exception that is not a transport error or a deadline: the app's own bug, not a
    fault of the account."""


class Phase(enum.StrEnum):
    """The deadline phase that ran out (`ctx.deadline_phase`, the `phase` label)."""

    TOTAL = "total"
    """A response that is not a stream was not whole in time."""
    HEADERS = "headers"
    """A stream did not start in time."""
    IDLE = "idle"
    """A stream went silent for longer than its idle limit."""
    BUDGET = "budget"
    """The caller's overall budget ran out: no account is to blame."""
    FIRST_TOKEN = "first_token"
    """A stream started (or not) but sent no content event within `first_token_secs`."""
    SLOW = "slow"
    """A stream's output rate stayed below `min_tokens_per_sec` over its window."""


class Gone(enum.StrEnum):
    """Why nobody waits for an attempt's answer any more: its lease goes back with no outcome."""

    DISCONNECTED = "disconnected"
    """The client left."""
    CANCELLED = "cancelled"
    """The work was cancelled (the server, a shutdown)."""
    RETRIED = "retried"
    """The front started another attempt on its own (Envoy retried) before any outcome."""
    LOCAL_REPLY = "local_reply"
    """The front answered itself (Envoy's own reply), so no account answered."""
    UNUSED = "unused"
    """A lease granted after the request ended: no attempt was sent with it."""
    HEDGE_LOST = "hedge_lost"
    """Another attempt of the same request produced its first content first (a hedge)."""


APP_ERROR = Failure.APP_ERROR
ACCOUNT_PHASES = frozenset({Phase.TOTAL, Phase.HEADERS, Phase.IDLE, Phase.FIRST_TOKEN, Phase.SLOW})
"""Deadline phases that are the account's fault (not `BUDGET`: the caller's)."""
OUT_OF_TIME = frozenset({Failure.DEADLINE, Failure.TIMEOUT})
"""Attempt failures that are answered 504, not 502."""
# Read on every attempt: module constants, since Enum member access is slow on Python 3.11.
_BUDGET = Phase.BUDGET
_DEADLINE = Failure.DEADLINE
_FAULT = Outcome.FAULT  # read on every attempt; Enum member access is slow on Python 3.11


class Limits(Protocol):
    """The limits the deadline rule reads: an account's (`LLMClient`) or a policy's own."""

    @property
    def timeout_secs(self) -> float: ...
    @property
    def stream_idle_secs(self) -> float: ...
    @property
    def default_max_tokens(self) -> int | None: ...


def start_secs(limits: Limits) -> float:
    """The longest a stream of an account with `limits` may take to start: its
    `first_token_secs`, or its `timeout_secs` when that is sooner (a stream without headers has
    no content either)."""
    return min(limits.timeout_secs, first_token_secs(limits))


def deadline_secs(view: RequestView, limits: Limits) -> float:
    """The attempt's first bound: a stream must start within `timeout_secs` (or its
    `first_token_secs`, when that is sooner: a stream without headers has no content either);
    any other response must be whole within the deadline rule's time, which grows with the
    output cap."""
    if view.stream:  # `start_secs`, written out: a call fewer on every attempt
        return min(limits.timeout_secs, first_token_secs(limits))
    return attempt_deadline_secs(
        timeout_secs=limits.timeout_secs,
        max_tokens=view.max_tokens,
        default_max_tokens=limits.default_max_tokens,
    )


def in_force(deadline_secs: float, budget_at: float | None, now: float) -> float:
    """The attempt's deadline as it binds from `now` (monotonic): its own, or what is left of
    the request's budget (`budget_at`) when that ends sooner; never below 0. What
    `x-switchyard-deadline-ms` and `switchyard.deadline_ms` report."""
    if budget_at is None or budget_at - now >= deadline_secs:
        return deadline_secs
    return max(budget_at - now, 0.0)


def outcome(
    status: int, *, deadline_phase: str | None = None, upstream_status: int | None = None
) -> tuple[Outcome, str]:
    """An answered attempt's outcome, and its status as metrics show it. `upstream_status`:
    what the upstream said when the app answered with another status."""
    if deadline_phase in ACCOUNT_PHASES:
        return _FAULT, _DEADLINE
    if upstream_status is not None:
        status = upstream_status
    return classify_status(status), str(status)


def verdict(
    status: int | None,
    *,
    finished: bool,
    gone: str | None,
    deadline_phase: str | None,
    upstream_status: int | None,
) -> tuple[Outcome | None, str]:
    """What an ended attempt says about its account; None: nothing (release the lease).

    `gone` names why nobody waits any more (the client left, the work was cancelled); a
    response already `finished` (whole at the client) still counts.
    """
    if gone is not None and not finished:
        return None, gone
    if status is None:
        return _FAULT, Failure.NO_RESPONSE
    if deadline_phase == _BUDGET:
        return None, _BUDGET  # the caller's budget ran out, whoever answered
    return outcome(status, deadline_phase=deadline_phase, upstream_status=upstream_status)


def error_kind(
    error: type[BaseException],
    *,
    deadline_phase: str | None,
    transport_error: type[BaseException] | None,
) -> Failure:
    """The `status` metrics show for an attempt that ended in `error` (raised or reported);
    `transport_error`: the outbound client's error the app reported, if any."""
    if deadline_phase in ACCOUNT_PHASES:
        return _DEADLINE
    if issubclass(error, httpx.ConnectError | httpx.ConnectTimeout | ConnectionError):
        return Failure.CONNECT_ERROR
    if issubclass(error, httpx.TimeoutException):
        return Failure.TIMEOUT
    if issubclass(error, httpx.TransportError | OSError):
        return Failure.TRANSPORT_ERROR
    if transport_error is error:
        return Failure.TRANSPORT_ERROR  # reported by the app, in its own client's terms
    if transport_error is not None:
        # Not a transport error itself, but raised after one (an app that wraps the error
        # in its own): the account is what failed.
        return error_kind(transport_error, deadline_phase=None, transport_error=None)
    return APP_ERROR


def start_span(
    lease: Lease, model: str | None, provider: str | None, parent: Context | None = None
) -> trace.Span:
    """The attempt's span: its account, whether it is a probe, the model and the provider.
    `parent`: the request's, when it is not the current span."""
    attributes: dict[str, str | bool] = {tm.ACCOUNT: lease.account, tm.ATTEMPT_PROBE: lease.probe}
    if model is not None:
        attributes[tm.REQUEST_MODEL] = model
    if provider is not None:
        attributes[tm.PROVIDER_NAME] = provider
    return tm.tracer.start_span(tm.SPAN_ATTEMPT, context=parent, attributes=attributes)


def mark_span(span: trace.Span, outcome: Outcome | None, status: str) -> None:
    """What the attempt's end said, on its span; a fault marks it failed."""
    if span.is_recording():
        span.set_attributes(
            {tm.ATTEMPT_STATUS: status, tm.ATTEMPT_OUTCOME: outcome.value if outcome else "none"}
        )
        if outcome is _FAULT:
            span.set_status(trace.StatusCode.ERROR, status)


def end_span(span: trace.Span, deadline_phase: str | None) -> None:
    if deadline_phase is not None:
        span.set_attribute(tm.DEADLINE_PHASE, deadline_phase)
    span.end()


def end_client_span(
    span: trace.Span, ctx: RequestContext, *, status: int | None, failure: str | None
) -> None:
    """End an attempt's GenAI CLIENT span, the same through both fronts: its `error.type` is
    `deadline_exceeded` when a deadline ended the attempt, else the failure (how the call
    failed, when no answer came), else the answer's status when it is 400 or more;
    `no_response` when there was neither."""
    if ctx.deadline_phase is not None:
        error: str | None = "deadline_exceeded"
    elif failure is not None:
        error = failure
    elif status is None:
        error = "no_response"
    else:
        error = str(status) if status >= 400 else None
    # `gen_ai.response.model`: the provider's own name for the model, where it has one.
    account = ctx.account
    provider_model = None if account is None else account.provider_model
    tm.end_client_span(
        span,
        model=provider_model or ctx.resolved_model,
        error=error,
        input_tokens=ctx.input_tokens,
        output_tokens=ctx.output_tokens,
        cache_read_tokens=ctx.cache_read_tokens,
        cache_write_tokens=ctx.cache_write_tokens,
    )


def first_token(ctx: RequestContext, piece: bytes) -> None:
    """Note when a stream's first content passed (`ctx.first_token_at`), the same through both
    fronts: a piece of a stream that carries a "delta" event (every wire's text chunks do).
    Call it while `ctx.first_token_at` is None."""
    view = ctx.view
    if view is not None and view.stream and b"delta" in piece:
        ctx.first_token_at = time.monotonic()
