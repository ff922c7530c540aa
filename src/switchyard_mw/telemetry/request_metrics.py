"""Request metrics for dashboards: duration, time to first token, token usage.

Recorded for every request switchyard places, under the OpenTelemetry GenAI names:
`gen_ai.client.operation.duration` (s), `gen_ai.server.time_to_first_token` (s) and
`gen_ai.client.token.usage` ({token}, by `gen_ai.token.type`), each labelled with the requested
and routed model, the variant, the account and `error.type` when the request failed.

Why not the SDK's own histograms: one `record()` costs about as much as the whole policy stack
does per request (attribute-set hashing, a lock and exemplar sampling, per reader). Here a
record is a dict lookup, a bisect and a few additions under a lock, and the totals are turned
into standard OpenTelemetry histogram points when a reader collects: `bridge(reader)` makes a
reader's collections carry them. `otel.configure()`, `prometheus.install()` bridge the readers
they build; an application with its own meter provider calls `bridge()` on its readers.
"""

from __future__ import annotations

import bisect
import math
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry import metrics

from ..core.pool import AccountPool, BreakerState
from . import names as tm

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import Metric, MetricReader, MetricsData

    from ..context import RequestContext

MAX_SERIES = 2000
"""Attribute sets one metric keeps; past it, points go to one `otel.metric.overflow` series
(as the SDK does): a requested model is any string a client sends."""
_OVERFLOW = ("\x00",) * 7  # no real label holds a NUL: model names with one are refused

Labels = tuple[str, str, str, str, str, str, str]
"""requested model, routed model, variant, account, error type ("" = none), token type,
shadow ("true" for a mirrored request, else "")."""
_NAMES = (
    tm.REQUEST_MODEL,
    tm.RESPONSE_MODEL,
    tm.VARIANT,
    tm.ACCOUNT,
    tm.ERROR_TYPE,
    tm.TOKEN_TYPE,
    tm.SHADOW,
)


class HistogramTally:
    """A cumulative explicit-bucket histogram kept as plain numbers, per attribute set."""

    def __init__(self, name: str, unit: str, description: str, bounds: Sequence[float]) -> None:
        self.name, self.unit, self.description = name, unit, description
        self.bounds = tuple(bounds)
        self._n = len(self.bounds) + 1
        # attribute set -> [count per bucket ..., count, sum, min, max]
        self._series: dict[Labels, list[float]] = {}
        self.start_ns = time.time_ns()

    def record(self, value: float, labels: Labels) -> None:
        # No lock: this runs on every request, and ASGI servers record from one event loop
        # thread. Where several threads record at once, an increment can (rarely) be lost;
        # a reading never sees a torn entry, since `metric()` copies each list whole.
        entry = self._series.get(labels)
        if entry is None:
            entry = self._new(labels, value)
        n = self._n
        entry[bisect.bisect_left(self.bounds, value)] += 1  # buckets are (lower, upper]
        entry[n] += 1
        entry[n + 1] += value
        if value < entry[n + 2]:
            entry[n + 2] = value
        elif value > entry[n + 3]:
            entry[n + 3] = value

    def _new(self, labels: Labels, value: float) -> list[float]:
        if len(self._series) >= MAX_SERIES:
            labels = _OVERFLOW
            found = self._series.get(labels)
            if found is not None:
                return found
        entry: list[float] = [0] * self._n + [0, 0.0, value, value]
        return self._series.setdefault(labels, entry)

    def metric(self, now_ns: int) -> Metric | None:
        """The totals so far as an OpenTelemetry histogram metric (None: nothing recorded)."""
        from opentelemetry.sdk.metrics.export import (
            AggregationTemporality,
            Histogram,
            HistogramDataPoint,
            Metric,
        )

        series = [(labels, list(entry)) for labels, entry in list(self._series.items())]
        if not series:
            return None
        n = len(self.bounds) + 1
        points = [
            HistogramDataPoint(
                attributes=_attributes(labels),
                start_time_unix_nano=self.start_ns,
                time_unix_nano=now_ns,
                count=int(entry[n]),
                sum=entry[n + 1],
                bucket_counts=[int(c) for c in entry[:n]],
                explicit_bounds=list(self.bounds),
                min=entry[n + 2],
                max=entry[n + 3],
            )
            for labels, entry in series
        ]
        data = Histogram(
            data_points=points, aggregation_temporality=AggregationTemporality.CUMULATIVE
        )
        return Metric(name=self.name, description=self.description, unit=self.unit, data=data)

    def clear(self) -> None:
        self._series.clear()


def _attributes(labels: Labels) -> dict[str, Any]:
    if labels == _OVERFLOW:
        return {"otel.metric.overflow": True}
    attributes: dict[str, Any] = {
        name: value for name, value in zip(_NAMES, labels, strict=True) if value
    }
    if tm.SHADOW in attributes:
        attributes[tm.SHADOW] = True
    return attributes


duration = HistogramTally(
    tm.OPERATION_DURATION, "s", "Requests as the client saw them, start to end", tm.SECONDS_BUCKETS
)
time_to_first_token = HistogramTally(
    tm.TIME_TO_FIRST_TOKEN, "s", "Streams: request start to the first content chunk",
    tm.SECONDS_BUCKETS,
)  # fmt: skip


class TokenTally(HistogramTally):
    """Input and output tokens under one key: a request's usage is one lookup, one call.

    An entry holds two histograms side by side (input, then output); each becomes its own
    point at collection, labelled `gen_ai.token.type`.
    """

    def record_usage(self, inputs: int | None, outputs: int | None, labels: Labels) -> None:
        entry = self._series.get(labels)
        if entry is None:
            entry = self._new_pair(labels)
        n = self._n
        for base, value in ((0, inputs), (n + 4, outputs)):
            if value is None:
                continue
            entry[base + bisect.bisect_left(self.bounds, value)] += 1
            entry[base + n] += 1
            entry[base + n + 1] += value
            if value < entry[base + n + 2]:
                entry[base + n + 2] = value
            if value > entry[base + n + 3]:
                entry[base + n + 3] = value

    def _new_pair(self, labels: Labels) -> list[float]:
        if len(self._series) >= MAX_SERIES:
            labels = _OVERFLOW
            found = self._series.get(labels)
            if found is not None:
                return found
        half: list[float] = [0] * self._n + [0, 0.0, math.inf, -math.inf]
        return self._series.setdefault(labels, half + half)

    def metric(self, now_ns: int) -> Metric | None:
        from opentelemetry.sdk.metrics.export import (
            AggregationTemporality,
            Histogram,
            HistogramDataPoint,
            Metric,
        )

        n = self._n
        points = []
        for labels, entry in [(k, list(v)) for k, v in list(self._series.items())]:
            for base, kind in ((0, "input"), (n + 4, "output")):
                if not entry[base + n]:
                    continue
                attributes = _attributes(labels)
                if labels != _OVERFLOW:
                    attributes[tm.TOKEN_TYPE] = kind
                points.append(
                    HistogramDataPoint(
                        attributes=attributes,
                        start_time_unix_nano=self.start_ns,
                        time_unix_nano=now_ns,
                        count=int(entry[base + n]),
                        sum=entry[base + n + 1],
                        bucket_counts=[int(c) for c in entry[base : base + n]],
                        explicit_bounds=list(self.bounds),
                        min=entry[base + n + 2],
                        max=entry[base + n + 3],
                    )
                )
        if not points:
            return None
        data = Histogram(
            data_points=points, aggregation_temporality=AggregationTemporality.CUMULATIVE
        )
        return Metric(name=self.name, description=self.description, unit=self.unit, data=data)


token_usage = TokenTally(
    tm.TOKEN_USAGE, "{token}", "Input and output tokens per request", tm.TOKEN_BUCKETS
)
TALLIES = (duration, time_to_first_token, token_usage)


def observe(ctx: RequestContext, end: float, error: str | None = None) -> None:
    """Record one finished request (monotonic `end`); `error`: why it failed, if it did."""
    view = ctx.view
    if view is None:
        return
    routed = ctx.resolved_model or ""
    client = ctx.client
    if error is None:
        status = ctx.response_status
        # The usual case first, without a call: answered, below 400, no deadline.
        if status is None or status >= 400 or ctx.deadline_phase is not None:
            error = _error_type(ctx)
    labels = (
        view.model,
        routed,
        ctx.variant or routed,
        "" if client is None else client.name,
        error or "",
        "",
        "",
    )
    duration.record(end - ctx.started_at, labels)
    if ctx.first_token_at is not None:
        time_to_first_token.record(ctx.first_token_at - ctx.started_at, labels)
    if ctx.input_tokens is not None or ctx.output_tokens is not None:
        token_usage.record_usage(ctx.input_tokens, ctx.output_tokens, labels)


def observe_shadow(
    *, requested: str, shadow: str, account: str, secs: float, error: str | None
) -> None:
    """Record one mirrored request (`switchyard.shadow = true`): its outcome and latency."""
    duration.record(secs, (requested, shadow, shadow, account, error or "", "", "true"))


def _error_type(ctx: RequestContext) -> str | None:
    """`error.type` of a finished request: the deadline, or the status it was answered with."""
    if ctx.deadline_phase is not None:
        return "deadline_exceeded"
    status = ctx.response_status
    if status is None:
        return "disconnected" if ctx.disconnected else "no_response"
    return str(status) if status >= 400 else None


# --- account state ----------------------------------------------------------------------------

CLOSED, HALF_OPEN, COOLED, THROTTLED = 0, 1, 2, 3
_STATE_CODES = {BreakerState.CLOSED: CLOSED, BreakerState.HALF_OPEN: HALF_OPEN}
_pools: weakref.WeakSet[AccountPool] = weakref.WeakSet()


def watch(pool: AccountPool) -> None:
    """Report `pool`'s accounts in `switchyard.account.state` (while the pool lives)."""
    _pools.add(pool)


def unwatch(pool: AccountPool) -> None:
    """Stop reporting `pool` (a reload replaced it: accounts it alone had disappear)."""
    _pools.discard(pool)


def account_state(pool: AccountPool, name: str) -> int:
    """0 closed, 1 half-open, 2 cooled, 3 throttled (held for every model it names)."""
    code = _STATE_CODES.get(pool.status_of(name).state, COOLED)
    if code == CLOSED:
        models = {m for m in pool.spec_of(name).models if m != "*"}
        if models and models <= set(pool.holds_of(name)):
            return THROTTLED
    return code


def _observe_states(_options: metrics.CallbackOptions) -> list[metrics.Observation]:
    # One observation per account name: the newest pool wins where tests built several.
    states = {name: account_state(pool, name) for pool in list(_pools) for name in pool.names}
    return [metrics.Observation(code, {tm.ACCOUNT: name}) for name, code in states.items()]


account_state_gauge = tm.meter.create_observable_gauge(
    tm.ACCOUNT_STATE,
    callbacks=[_observe_states],
    unit="1",
    description="Each account's state: 0 closed, 1 half-open, 2 cooled, 3 throttled",
)


# --- export ---------------------------------------------------------------------------------


def add_to(metrics_data: MetricsData | None) -> MetricsData | None:
    """`metrics_data` with the request metrics added to switchyard's scope."""
    from opentelemetry.sdk.metrics.export import MetricsData, ResourceMetrics, ScopeMetrics
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    now = time.time_ns()
    ours = [m for m in (t.metric(now) for t in TALLIES) if m is not None]
    if not ours:
        return metrics_data
    resources = [] if metrics_data is None else list(metrics_data.resource_metrics)
    if not resources:  # nothing else recorded yet: the provider's resource is not at hand
        resources = [
            ResourceMetrics(resource=Resource.get_empty(), scope_metrics=[], schema_url="")
        ]
    first = resources[0]
    scopes = list(first.scope_metrics)
    for i, found in enumerate(scopes):
        if found.scope.name == tm.SCOPE:
            scopes[i] = ScopeMetrics(found.scope, [*found.metrics, *ours], found.schema_url)
            break
    else:
        own = InstrumentationScope(tm.SCOPE, tm.__version__)
        scopes.append(ScopeMetrics(scope=own, metrics=ours, schema_url=""))
    resources[0] = ResourceMetrics(first.resource, scopes, first.schema_url)
    return MetricsData(resource_metrics=resources)


Collect = Callable[..., "MetricsData | None"]


def bridge(reader: MetricReader) -> MetricReader:
    """Make every collection of `reader` carry the request metrics; returns `reader`.

    A reader collects through the callback its meter provider registers on it
    (`_set_collect_callback`); this wraps that callback on this instance, whether the reader
    is registered yet or not, so the request metrics are there even when nothing else was
    recorded (the SDK then collects nothing at all). Idempotent.
    """
    # The SDK types these hooks for its own provider only: reached through `Any` here.
    target: Any = reader
    if getattr(target, "_switchyard_bridged", False):
        return reader
    target._switchyard_bridged = True

    def with_requests(collect: Collect) -> Collect:
        def collect_with_requests(*args: Any, **kwargs: Any) -> MetricsData | None:
            return add_to(collect(*args, **kwargs))

        return collect_with_requests

    registered: Collect | None = target._collect
    if registered is not None:
        target._collect = with_requests(registered)
        return reader
    register = target._set_collect_callback

    def register_with_requests(func: Collect) -> None:
        register(with_requests(func))

    target._set_collect_callback = register_with_requests
    return reader
