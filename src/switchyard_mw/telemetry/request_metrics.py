"""Request metrics for dashboards: duration, time to first token, token usage.

Recorded for every request switchyard places, under the OpenTelemetry GenAI names:
`gen_ai.client.operation.duration` (s), `gen_ai.server.time_to_first_token` (s) and
`gen_ai.client.token.usage` ({token}, by `gen_ai.token.type`: input, output, and the parts of
the input read from (`cache_read`) and written to (`cache_creation`) the provider's prompt
cache, where the answer says them), each labelled with the requested
and routed model, the variant, the account and `error.type` when the request failed.

Why not the SDK's own histograms: one `record()` costs about as much as the whole policy stack
does per request (attribute-set hashing, a lock and exemplar sampling, per reader). Here a
finished request is one dict lookup and one extend by its raw numbers (`RequestTally.observe`);
they are folded into per-label-set bucket counts in batches, when a reader collects or when
`FOLD_AT` requests are held, and the totals are turned into standard OpenTelemetry histogram
points when a reader collects: `bridge(reader)` makes a reader's collections carry them.
`otel.configure()`, `prometheus.install()` bridge the readers they build; an application with
its own meter provider calls `bridge()` on its readers.
"""

from __future__ import annotations

import bisect
import math
import operator
import threading
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
_OVERFLOW = ("\x00",) * 8  # no real label holds a NUL: model names with one are refused
FOLD_AT = 4096
"""Finished requests held raw (about 200 bytes each) before the request that reaches this
many folds them all into the histograms: memory stays bounded however long between scrapes."""

Labels = tuple[str, str, str, str, str, str, str, str]
"""requested model, routed model, variant, account, error type ("" = none), token type,
shadow ("true" for a mirrored request, else ""), tenant ("" = no tenants configured)."""
_NAMES = (
    tm.REQUEST_MODEL,
    tm.RESPONSE_MODEL,
    tm.VARIANT,
    tm.ACCOUNT,
    tm.ERROR_TYPE,
    tm.TOKEN_TYPE,
    tm.SHADOW,
    tm.TENANT,
)


class HistogramTally:
    """A cumulative explicit-bucket histogram kept as plain numbers, per attribute set.

    Values arrive in batches (`add`), folded by a `RequestTally` under its lock.
    """

    def __init__(self, name: str, unit: str, description: str, bounds: Sequence[float]) -> None:
        self.name, self.unit, self.description = name, unit, description
        self.bounds = tuple(bounds)
        self._n = len(self.bounds) + 1
        # attribute set -> [count per bucket ..., count, sum, min, max]
        self._series: dict[Labels, list[float]] = {}
        self.start_ns = time.time_ns()

    def record(self, value: float, labels: Labels) -> None:
        """One value at once (a caller that keeps no batch of its own)."""
        self.add([value], labels)

    def add(self, values: list[float], labels: Labels) -> None:
        """Fold `values` (sorted here, in place) into the series of `labels`."""
        entry = self._series.get(labels)
        if entry is None:
            entry = self._new(labels, 1)
        self._fold(entry, 0, values)

    def _fold(self, entry: list[float], base: int, values: list[float]) -> None:
        # Sorted, the values at or below each bound are one bisect away: a bucket's count is
        # the difference of two of them, and (lower, upper] is what bisect_right gives.
        values.sort()
        total = len(values)
        below = 0
        for i, bound in enumerate(self.bounds):
            upto = bisect.bisect_right(values, bound)
            entry[base + i] += upto - below
            below = upto
            if below == total:
                break
        n = self._n
        entry[base + n - 1] += total - below
        entry[base + n] += total
        entry[base + n + 1] += sum(values)
        entry[base + n + 2] = min(entry[base + n + 2], values[0])
        entry[base + n + 3] = max(entry[base + n + 3], values[-1])

    def _new(self, labels: Labels, histograms: int) -> list[float]:
        if len(self._series) >= MAX_SERIES:
            labels = _OVERFLOW
            found = self._series.get(labels)
            if found is not None:
                return found
        one: list[float] = [0] * self._n + [0, 0.0, math.inf, -math.inf]
        return self._series.setdefault(labels, one * histograms)

    def metric(self, now_ns: int) -> Metric | None:
        """The totals so far as an OpenTelemetry histogram metric (None: nothing recorded)."""
        series = [(labels, list(entry)) for labels, entry in list(self._series.items())]
        points = [self._point(_attributes(labels), entry, 0, now_ns) for labels, entry in series]
        return self._metric(points)

    def _point(self, attributes: dict[str, Any], entry: list[float], base: int, now_ns: int) -> Any:
        from opentelemetry.sdk.metrics.export import HistogramDataPoint

        n = self._n
        return HistogramDataPoint(
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

    def _metric(self, points: list[Any]) -> Metric | None:
        from opentelemetry.sdk.metrics.export import AggregationTemporality, Histogram, Metric

        if not points:
            return None
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


class TokenTally(HistogramTally):
    """Tokens by type under one key: a request's usage is one entry.

    An entry holds one histogram per `gen_ai.token.type` side by side (`tm.TOKEN_TYPES`:
    input, output, cache read, cache creation); each that holds values becomes its own point
    at collection, labelled with its type. Cache reads and creations are parts of the input
    (the conventions' `input` counts every input token), recorded when the answer said them.
    """

    _TYPES = len(tm.TOKEN_TYPES)

    def record_usage(
        self,
        inputs: int | None,
        outputs: int | None,
        labels: Labels,
        cache_read: int | None = None,
        cache_write: int | None = None,
    ) -> None:
        """One request's usage at once (a caller that keeps no batch of its own)."""
        counts = (inputs, outputs, cache_read, cache_write)
        self.add_usage(labels, [[] if count is None else [count] for count in counts])

    def add_usage(self, labels: Labels, by_type: Sequence[list[float]]) -> None:
        """Fold a batch of counts per token type, in `tm.TOKEN_TYPES`' order (each list is
        sorted here, in place; an empty one adds nothing)."""
        entry = self._series.get(labels)
        if entry is None:
            entry = self._new(labels, self._TYPES)
        width = self._n + 4
        for i, values in enumerate(by_type):
            if values:
                self._fold(entry, i * width, values)

    def metric(self, now_ns: int) -> Metric | None:
        n = self._n
        width = n + 4
        points = []
        for labels, entry in [(k, list(v)) for k, v in list(self._series.items())]:
            for i, kind in enumerate(tm.TOKEN_TYPES):
                base = i * width
                if not entry[base + n]:
                    continue
                attributes = _attributes(labels)
                if labels != _OVERFLOW:
                    attributes[tm.TOKEN_TYPE] = kind
                points.append(self._point(attributes, entry, base, now_ns))
        return self._metric(points)


Key = tuple[str, str, str, str, str, str, str]
"""A finished request's label set: requested model, routed model, variant, account, error
type ("" = none), shadow ("true" for a mirrored request, else ""), tenant ("" = none)."""
Held = list[Any]
"""Finished requests' raw numbers, seven a request: started, ended, first token at (monotonic
seconds; None: no stream), input, output, cache read and cache write tokens (None: not
reported)."""
_STRIDE = 7
_OVERFLOW_KEY: Key = ("\x00",) * 7


class RequestTally:
    """Finished requests, held raw per label set and folded into the histograms in batches.

    `observe` runs on every request: one dict lookup keyed by the label set and one extend.
    `collect` (each reader's collection) and every `fold_at`-th request fold what is held.
    Appends need no lock (one event loop thread observes; `list += tuple` is one C call);
    folds take one, since a reader may collect on its own thread (the Prometheus exporter
    does): a fold takes the first `len` values of a list and deletes exactly those, so a
    value appended meanwhile stays for the next fold, neither lost nor counted twice.
    """

    def __init__(
        self,
        *,
        duration: HistogramTally,
        first_token: HistogramTally,
        tokens: TokenTally,
        fold_at: int = FOLD_AT,
    ) -> None:
        self.duration, self.first_token, self.tokens = duration, first_token, tokens
        self.fold_at = fold_at
        self.held = 0
        """Requests observed since the last fold (approximate where threads race: a bound)."""
        self._raw: dict[Key, Held] = {}
        self._lock = threading.Lock()

    def observe(self, ctx: RequestContext, end: float, error: str | None = None) -> None:
        """Record one finished request (monotonic `end`); `error`: why it failed, if it did."""
        view = ctx.view
        if view is None:
            return
        routed = ctx.resolved_model or ""
        client = ctx.account
        if error is None:
            status = ctx.response_status
            # The usual case first, without a call: answered, below 400, no deadline.
            if status is None or status >= 400 or ctx.deadline_phase is not None:
                error = _error_type(ctx)
        key = (
            view.model,
            routed,
            ctx.variant or routed,
            "" if client is None else client.name,
            error or "",
            "",
            ctx.tenant or "",
        )
        raw = self._raw.get(key)
        if raw is None:
            raw = self._new(key)
        # Flat, not a tuple per request: floats and ints are not tracked by the garbage
        # collector, so what is held never triggers or slows a collection.
        raw += (
            ctx.started_at,
            end,
            ctx.first_token_at,
            ctx.input_tokens,
            ctx.output_tokens,
            ctx.cache_read_tokens,
            ctx.cache_write_tokens,
        )
        self.held += 1
        if self.held >= self.fold_at:
            self.fold()

    def observe_shadow(
        self, *, requested: str, shadow: str, account: str, secs: float, error: str | None
    ) -> None:
        """Record one mirrored request (`switchyard.shadow = true`): its outcome and latency."""
        key = (requested, shadow, shadow, account, error or "", "true", "")
        raw = self._raw.get(key)
        if raw is None:
            raw = self._new(key)
        raw += (0.0, secs, None, None, None, None, None)
        self.held += 1
        if self.held >= self.fold_at:
            self.fold()

    def _new(self, key: Key) -> Held:
        # A key stays once seen, so the keys are the series: the same bound applies.
        if len(self._raw) >= MAX_SERIES:
            key = _OVERFLOW_KEY
        return self._raw.setdefault(key, [])

    def fold(self) -> None:
        """Fold every request held into the histograms."""
        with self._lock:
            self._fold()

    def collect(self, now_ns: int) -> list[Metric]:
        """Fold what is held, then each histogram's totals (those with points)."""
        with self._lock:
            self._fold()
            found = (t.metric(now_ns) for t in (self.duration, self.first_token, self.tokens))
            return [m for m in found if m is not None]

    def _fold(self) -> None:
        self.held = 0
        for key, raw in list(self._raw.items()):
            count = len(raw)
            if not count:
                continue
            batch = raw[:count]
            del raw[:count]
            self._fold_batch(_OVERFLOW if key == _OVERFLOW_KEY else (*key[:5], "", *key[5:]), batch)

    def _fold_batch(self, labels: Labels, batch: Held) -> None:
        starts, ends, firsts, *tokens = (batch[i::_STRIDE] for i in range(_STRIDE))
        self.duration.add(list(map(operator.sub, ends, starts)), labels)
        if firsts.count(None) < len(firsts):
            pairs = zip(starts, firsts, strict=True)
            self.first_token.add(
                [first - start for start, first in pairs if first is not None], labels
            )
        by_type = [_reported(counts) for counts in tokens]
        if any(by_type):
            self.tokens.add_usage(labels, by_type)


def _reported(values: Held) -> list[float]:
    """`values` without the Nones (the usual batch has all or none: no loop in Python then)."""
    missing = values.count(None)
    if missing == len(values):
        return []
    if not missing:
        return values
    return [value for value in values if value is not None]


duration = HistogramTally(
    tm.OPERATION_DURATION, "s", "Requests as the client saw them, start to end", tm.SECONDS_BUCKETS
)
time_to_first_token = HistogramTally(
    tm.TIME_TO_FIRST_TOKEN, "s", "Streams: request start to the first content chunk",
    tm.SECONDS_BUCKETS,
)  # fmt: skip
token_usage = TokenTally(
    tm.TOKEN_USAGE,
    "{token}",
    "Input and output tokens per request (cache reads and creations: parts of the input)",
    tm.TOKEN_BUCKETS,
)
TALLIES = (duration, time_to_first_token, token_usage)
requests = RequestTally(duration=duration, first_token=time_to_first_token, tokens=token_usage)
observe = requests.observe
observe_shadow = requests.observe_shadow


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


def pair_states(pool: AccountPool, name: str) -> dict[str, int]:
    """The state of each model of `name` whose health differs from the account's own (an
    account serving several models keeps their faults per model), as `account_state` codes.
    A model no account names is reported as "*" (a wildcard account serves any string a
    client sends, and a label must stay bounded): the worst of those."""
    states: dict[str, int] = {}
    holds = pool.holds_of(name)
    for model, status in pool.pair_status(name).items():
        code = _STATE_CODES.get(status.state, COOLED)
        if code == CLOSED and model in holds:
            code = THROTTLED
        label = model if model in pool.named_models else "*"
        states[label] = max(code, states.get(label, CLOSED))
    return states


def _observe_states(_options: metrics.CallbackOptions) -> list[metrics.Observation]:
    # One observation per account name (and per model where a pair differs): the newest pool
    # wins where tests built several.
    states: dict[tuple[str, str | None], int] = {}
    for pool in list(_pools):
        for name in pool.names:
            states[(name, None)] = account_state(pool, name)
            for model, code in pair_states(pool, name).items():
                states[(name, model)] = code
    return [
        metrics.Observation(
            code,
            {tm.ACCOUNT: name} if model is None else {tm.ACCOUNT: name, tm.RESPONSE_MODEL: model},
        )
        for (name, model), code in states.items()
    ]


account_state_gauge = tm.meter.create_observable_gauge(
    tm.ACCOUNT_STATE,
    callbacks=[_observe_states],
    unit="1",
    description=(
        "Each account's state (and each model's, where it differs): 0 closed, 1 half-open, "
        "2 cooled, 3 throttled"
    ),
)


# --- export ---------------------------------------------------------------------------------


def add_to(metrics_data: MetricsData | None) -> MetricsData | None:
    """`metrics_data` with the request metrics added to switchyard's scope."""
    from opentelemetry.sdk.metrics.export import MetricsData, ResourceMetrics, ScopeMetrics
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    ours = requests.collect(time.time_ns())
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
