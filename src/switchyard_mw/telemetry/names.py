"""Every telemetry name switchyard emits, and the tracer and instruments that emit them.

Names here are a contract (dashboards and alerts are built on them): change none lightly.
Without an OpenTelemetry SDK configured, every call below is the API's no-op.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
from collections.abc import Iterable
from contextlib import AbstractContextManager
from importlib.metadata import version
from urllib.parse import urlsplit

from opentelemetry import metrics, trace

__version__ = version("switchyard-mw")

SCOPE = "switchyard_mw"

# Metric names.
CLASSIFIER_FAIL_OPEN = "switchyard.classifier_fail_open"
ACCOUNT_FAULTS = "switchyard.account.faults"
ACCOUNT_COOLED = "switchyard.account.cooled"
ACCOUNT_THROTTLED = "switchyard.account.throttled"
OPERATION_DURATION = "gen_ai.client.operation.duration"
TIME_TO_FIRST_TOKEN = "gen_ai.server.time_to_first_token"
TOKEN_USAGE = "gen_ai.client.token.usage"
ACCOUNT_STATE = "switchyard.account.state"
CANARY_GUARD_TRIPS = "switchyard.canary.guard_trips"
SHADOW_DROPPED = "switchyard.shadow.dropped"
FAILOVERS = "switchyard.failovers"
FALLBACKS = "switchyard.fallbacks"
HEDGES = "switchyard.hedges"
DEADLINE_EXCEEDED = "switchyard.deadline.exceeded"
VARIANT_ASSIGNMENTS = "switchyard.variant.assignments"
JUDGE_DURATION = "switchyard.judge.duration"
BUDGET_INVALID = "switchyard.budget.invalid"
STATE_DEGRADED = "switchyard.state.degraded"
CONFIG_RELOADS = "switchyard.config.reloads"
USAGE_UNREAD = "switchyard.usage.unread"
RESUMES = "switchyard.resumes"
RESUMED_BYTES = "switchyard.resume.bytes"
COST = "switchyard.cost"
LIMIT_REFUSALS = "switchyard.limit.refusals"

# Span names.
SPAN_REQUEST = "switchyard.request"
SPAN_JUDGE = "switchyard.judge"
SPAN_ATTEMPT = "switchyard.attempt"
SPAN_OUTBOUND = "POST"
SPAN_CLIENT = "chat {model}"
"""The GenAI-convention CLIENT span of each upstream attempt (a template: the model routed)."""
"""The outbound call to the provider: a CLIENT span named by its HTTP method (HTTP conventions)."""

# Attribute names (OpenTelemetry GenAI conventions where they exist).
REQUEST_MODEL = "gen_ai.request.model"
RESPONSE_MODEL = "gen_ai.response.model"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
OPERATION_NAME = "gen_ai.operation.name"
PROVIDER_NAME = "gen_ai.provider.name"
ACCOUNT = "switchyard.account"
ATTEMPTS = "switchyard.attempts"
DEADLINE_MS = "switchyard.deadline_ms"
ROUTE = "switchyard.route"
VARIANT_KEY_KIND = "switchyard.variant.key"
VARIANT_KEY_HASH = "switchyard.variant.key_hash"
ATTEMPT_STATUS = "switchyard.attempt.status"
ATTEMPT_OUTCOME = "switchyard.attempt.outcome"
ATTEMPT_PROBE = "switchyard.attempt.probe"
FALLBACK = "switchyard.fallback"
"""On an attempt span whose model a fallback chain chose: why (`unavailable`, `context_length`)."""
HEDGE = "switchyard.hedge"
"""On the attempt span of a hedge (a second attempt racing the first for its first token)."""
JUDGE_ROUTE = "switchyard.judge.route"
JUDGE_OUTCOME = "switchyard.judge.outcome"
JUDGE_LABEL = "switchyard.judge.label"
JUDGE_REASON = "switchyard.judge.reason"
DEADLINE_PHASE = "switchyard.deadline.phase"
RESUMED_FROM = "switchyard.resume.from"
"""On the attempt span of a resumed stream's continuation: the account whose stream broke."""
RESUME_REASON = "switchyard.resume.reason"
"""On a continuation's attempt span: how the stream broke (`cut`, `idle`, `slow`)."""
RESUMED_AFTER = "switchyard.resume.after_bytes"
"""On a continuation's attempt span: the stream's bytes the client had when it broke."""
USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
USAGE_CACHE_READ_TOKENS = "gen_ai.usage.cache_read.input_tokens"
USAGE_CACHE_CREATION_TOKENS = "gen_ai.usage.cache_creation.input_tokens"
ERROR_TYPE = "error.type"
VARIANT = "switchyard.variant"
SHADOW = "switchyard.shadow"
TENANT = "switchyard.tenant"
TOKEN_TYPE = "gen_ai.token.type"
# `gen_ai.token.type` values. The conventions define `input` (every input token, cached ones
# included) and `output`, and allow other values where neither applies; cache reads and writes
# take the names of the conventions' span attributes for them (`gen_ai.usage.cache_read.
# input_tokens`, `gen_ai.usage.cache_creation.input_tokens`). They are parts of `input`, not
# added to it: a sum over every type counts them twice.
TOKEN_TYPES = ("input", "output", "cache_read", "cache_creation")
HTTP_METHOD = "http.request.method"
HTTP_STATUS = "http.response.status_code"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
URL_FULL = "url.full"

# The labels of each metric family. One concept has one label name in every family, the same
# as the span attribute where one exists, so a PromQL join needs no `label_replace`: the
# account is `switchyard.account` (Prometheus `switchyard_account`), the model the client asked
# for (or, on a canary's counters, the canary's base) `gen_ai.request.model`, the model routed
# to `gen_ai.response.model`, the canary variant `switchyard.variant`. The GenAI conventions
# name the models (and the request metrics must use their names); the account and the variant
# have no convention, so they keep the names the request metrics and spans already had.
METRIC_LABELS: dict[str, tuple[str, ...]] = {
    CLASSIFIER_FAIL_OPEN: ("route", "reason"),
    ACCOUNT_FAULTS: (ACCOUNT, "status"),
    ACCOUNT_COOLED: (ACCOUNT,),
    ACCOUNT_THROTTLED: (ACCOUNT, RESPONSE_MODEL),
    CANARY_GUARD_TRIPS: (REQUEST_MODEL, VARIANT),
    SHADOW_DROPPED: (RESPONSE_MODEL,),
    FAILOVERS: (RESPONSE_MODEL,),
    FALLBACKS: (REQUEST_MODEL, RESPONSE_MODEL, "reason"),
    HEDGES: (RESPONSE_MODEL, "result"),
    DEADLINE_EXCEEDED: ("phase",),
    VARIANT_ASSIGNMENTS: (REQUEST_MODEL, VARIANT, "key"),
    JUDGE_DURATION: ("route", "outcome"),
    BUDGET_INVALID: ("header",),
    STATE_DEGRADED: (),
    CONFIG_RELOADS: ("result",),
    USAGE_UNREAD: (RESPONSE_MODEL, ACCOUNT, "reason"),
    RESUMES: (RESPONSE_MODEL, "reason", "result"),
    RESUMED_BYTES: (RESPONSE_MODEL, "reason"),
    OPERATION_DURATION: (
        REQUEST_MODEL,
        RESPONSE_MODEL,
        VARIANT,
        ACCOUNT,
        ERROR_TYPE,
        SHADOW,
        TENANT,
    ),
    TIME_TO_FIRST_TOKEN: (
        REQUEST_MODEL,
        RESPONSE_MODEL,
        VARIANT,
        ACCOUNT,
        ERROR_TYPE,
        SHADOW,
        TENANT,
    ),
    TOKEN_USAGE: (
        REQUEST_MODEL,
        RESPONSE_MODEL,
        VARIANT,
        ACCOUNT,
        ERROR_TYPE,
        SHADOW,
        TOKEN_TYPE,
        TENANT,
    ),
    COST: (TENANT, RESPONSE_MODEL),
    LIMIT_REFUSALS: (TENANT, "limit"),
    ACCOUNT_STATE: (ACCOUNT, RESPONSE_MODEL),
}
"""Each metric family's label names (a label may be absent from a point: `error.type` when
nothing failed). tests/telemetry check every call site and the docs against it."""

tracer = trace.get_tracer(SCOPE, __version__)
meter = metrics.get_meter(SCOPE, __version__)

classifier_fail_open = meter.create_counter(
    CLASSIFIER_FAIL_OPEN, unit="{request}", description="Judge consultations that failed open"
)
account_faults = meter.create_counter(
    ACCOUNT_FAULTS, unit="{attempt}", description="Upstream attempts that were account faults"
)
account_cooled = meter.create_counter(
    ACCOUNT_COOLED, unit="{cooling}", description="Times an account started cooling"
)
account_throttled = meter.create_counter(
    ACCOUNT_THROTTLED,
    unit="{hold}",
    description="Throttle holds: a 429 with a retry time kept an account out for a model",
)
canary_guard_trips = meter.create_counter(
    CANARY_GUARD_TRIPS,
    unit="{trip}",
    description="Canary variants the guard rolled back (their share set to 0)",
)
shadow_dropped = meter.create_counter(
    SHADOW_DROPPED,
    unit="{request}",
    description="Shadow requests not sent: shadow_max_inflight were already in flight",
)
failovers = meter.create_counter(
    FAILOVERS, unit="{attempt}", description="Attempts moved to another account"
)
fallbacks = meter.create_counter(
    FALLBACKS,
    unit="{attempt}",
    description="Attempts moved to the next model of a fallback chain (from, to, reason)",
)
hedges = meter.create_counter(
    HEDGES,
    unit="{request}",
    description="Hedged first tokens: a second attempt won, lost, or was refused by the budget",
)
deadline_exceeded = meter.create_counter(
    DEADLINE_EXCEEDED, unit="{request}", description="Deadlines that expired, by phase"
)
resumes = meter.create_counter(
    RESUMES,
    unit="{stream}",
    description="Streams that broke after their content started and were to be resumed, by "
    "how they broke and the result (resumed, refused, failed, unavailable)",
)
cost = meter.create_counter(
    COST,
    unit="USD",
    description="What tenants' answers cost at [prices], by tenant and routed model",
)
limit_refusals = meter.create_counter(
    LIMIT_REFUSALS,
    unit="{request}",
    description="Requests a tenant's or the deployment's limit refused (429), by tenant and limit",
)
BYTES_BUCKETS = (256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304)
"""Bucket bounds of the byte histograms: 256 B to 4 MiB, by powers of four."""
resumed_bytes = meter.create_histogram(
    RESUMED_BYTES,
    unit="By",
    description="How far into a stream it broke: the bytes the client had, per resume tried",
    explicit_bucket_boundaries_advisory=BYTES_BUCKETS,
)


class _Tally:
    """A counter read on every canaried request, kept as plain totals here.

    An SDK counter's `add()` costs tens of microseconds per call (attribute set, storage
    lookup, lock, per reader); this one costs a dict increment, and the totals reach
    OpenTelemetry as an observable counter, read at each collection. Exported the same way:
    a monotonic cumulative sum with the same name, unit and attributes.
    """

    def __init__(self, names: tuple[str, ...]) -> None:
        self._names = names
        # One `itertools.count` per attribute set: `next()` on it is a single C call, atomic
        # under the GIL, so event loops in several threads count exactly without a lock.
        self._counts: dict[tuple[str, ...], itertools.count[int]] = {}

    def add(self, *values: str) -> None:
        counter = self._counts.get(values)
        if counter is None:
            counter = self._counts.setdefault(values, itertools.count(1))
        next(counter)

    def observe(self, _options: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
        for values, counter in list(self._counts.items()):
            count = int(repr(counter)[6:-1]) - 1  # "count(N)": N is the next value it gives
            yield metrics.Observation(count, dict(zip(self._names, values, strict=True)))


variant_assignments = _Tally((REQUEST_MODEL, VARIANT, "key"))
"""`add(model, variant, key_kind)`: one canary decision."""
variant_assignments_counter = meter.create_observable_counter(
    VARIANT_ASSIGNMENTS,
    callbacks=[variant_assignments.observe],
    unit="{request}",
    description="Canary decisions, by variant and key kind",
)
SECONDS_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
    320.0, 600.0,
)  # fmt: skip
"""Bucket bounds of every histogram in seconds: 5 ms to 10 min (a cached reply to the longest
answer the deadline rule allows). The SDK's default bounds (5 to 10,000) are meant for
milliseconds: in them every judge call would land in the first bucket."""
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576)
"""Bucket bounds of every histogram in tokens: 1 to 1M, by powers of four (the GenAI
conventions' advice)."""

# Buckets as the API's advice: a view the application configures still wins.
judge_duration = meter.create_histogram(
    JUDGE_DURATION,
    unit="s",
    description="Time spent consulting the judge",
    explicit_bucket_boundaries_advisory=SECONDS_BUCKETS,
)
budget_invalid = meter.create_counter(
    BUDGET_INVALID, unit="{request}", description="Budget headers ignored as invalid"
)
state_degraded = meter.create_counter(
    STATE_DEGRADED, unit="{event}", description="Times the shared state store was unreachable"
)
usage_unread = meter.create_counter(
    USAGE_UNREAD,
    unit="{answer}",
    description="Successful answers whose token usage was not read (compressed beyond reach)",
)
config_reloads = meter.create_counter(
    CONFIG_RELOADS,
    unit="{reload}",
    description="Config reloads, by result: ok (in force) or rejected (the old one stays)",
)


def short_hash(value: str) -> str:
    """A user key as telemetry may show it: 12 hex digits, never the key itself."""
    return hashlib.blake2b(value.encode(), digest_size=6).hexdigest()


# Providers by API host, as the GenAI conventions name them (`gen_ai.provider.name`). Only hosts
# that identify their provider beyond doubt: a gateway, proxy or mock on another host gets no
# name, because a wrong one would mislead a dashboard more than a missing one.
_PROVIDER_HOSTS = {
    "api.anthropic.com": "anthropic",
    "api.openai.com": "openai",
    "api.deepseek.com": "deepseek",
    "api.mistral.ai": "mistral_ai",
    "api.groq.com": "groq",
    "api.x.ai": "x_ai",
    "api.perplexity.ai": "perplexity",
    "api.cohere.com": "cohere",
}
_PROVIDER_SUFFIXES = (
    (".openai.azure.com", "azure.ai.openai"),
    ("aiplatform.googleapis.com", "gcp.vertex_ai"),  # `{region}-aiplatform...` and global
)


@functools.lru_cache(maxsize=256)
def provider_name(base_url: str) -> str | None:
    """`gen_ai.provider.name` of an account's `base_url`, or None when the host does not say.

    Cached: a process has a handful of accounts, and requests must not parse URLs.
    """
    host = (urlsplit(base_url).hostname or "").lower()
    name = _PROVIDER_HOSTS.get(host)
    if name is None:
        name = next((n for suffix, n in _PROVIDER_SUFFIXES if host.endswith(suffix)), None)
    if name is None and host.startswith("bedrock-runtime.") and host.endswith(".amazonaws.com"):
        name = "aws.bedrock"  # `bedrock-runtime.{region}.amazonaws.com` (and its FIPS hosts)
    return name


def start_client_span(
    parent: trace.Span, *, model: str | None, base_url: str, max_tokens: int | None
) -> trace.Span:
    """The GenAI-convention CLIENT span of one upstream attempt, under its attempt span:
    `chat {model}`, so LLM-observability tools (Phoenix, Langfuse, GenAI views) recognise it.
    switchyard's own attributes stay on `switchyard.attempt`; no prompt or completion text."""
    # All three wires are chat completions: one `gen_ai.operation.name` for every call.
    attributes: dict[str, str | int] = {OPERATION_NAME: "chat"}
    if model is not None:
        attributes[REQUEST_MODEL] = model
    if (provider := provider_name(base_url)) is not None:
        attributes[PROVIDER_NAME] = provider
    if max_tokens is not None:
        attributes[REQUEST_MAX_TOKENS] = max_tokens
    return tracer.start_span(
        SPAN_CLIENT.format(model=model) if model else "chat",
        context=trace.set_span_in_context(parent),
        kind=trace.SpanKind.CLIENT,
        attributes=attributes,
    )


def end_client_span(
    span: trace.Span,
    *,
    model: str | None,
    error: str | None,
    input_tokens: int | None,
    output_tokens: int | None,
    cache_read_tokens: int | None = None,
    cache_write_tokens: int | None = None,
) -> None:
    """End a `start_client_span` span with what the attempt gave back."""
    if span.is_recording():
        attributes: dict[str, str | int] = {}
        if model is not None:
            attributes[RESPONSE_MODEL] = model
        usage = usage_attributes(input_tokens, output_tokens, cache_read_tokens, cache_write_tokens)
        attributes.update(usage)
        if error is not None:
            attributes[ERROR_TYPE] = error
            span.set_status(trace.StatusCode.ERROR, error)
        span.set_attributes(attributes)
    span.end()


def usage_attributes(
    inputs: int | None, outputs: int | None, cache_read: int | None, cache_write: int | None
) -> dict[str, int]:
    """A request's or an attempt's token usage as the GenAI conventions' span attributes
    (those the answer did not report are left out)."""
    found = (
        (USAGE_INPUT_TOKENS, inputs),
        (USAGE_OUTPUT_TOKENS, outputs),
        (USAGE_CACHE_READ_TOKENS, cache_read),
        (USAGE_CACHE_CREATION_TOKENS, cache_write),
    )
    return {name: value for name, value in found if value is not None}


def tracing() -> bool:
    """Whether an SDK (any real tracer provider) is installed, so that spans are worth making.

    Without one, `get_tracer_provider()` returns the API's proxy: a type check, no allocation.
    Lets the hot path skip building attributes, propagation carriers and parsing for spans
    that would all be no-ops.
    """
    global _tracing
    if _tracing:
        return True  # a provider, once set, stays set for the process
    # `get_tracer_provider()` reads an environment variable on every call while none is set;
    # the module global it falls back on answers the same question without that cost.
    provider = getattr(trace, "_TRACER_PROVIDER", _UNKNOWN)
    if provider is None:
        return False  # the usual answer without an SDK, before any type check
    if provider is _UNKNOWN:
        provider = trace.get_tracer_provider()
    _tracing = provider is not None and not isinstance(provider, trace.ProxyTracerProvider)
    return _tracing


_UNKNOWN = object()
_tracing = False


_NO_SPAN: AbstractContextManager[None] = contextlib.nullcontext()  # stateless: reusable


def activate(span: trace.Span) -> AbstractContextManager[object]:
    """Make `span` current for a block, unless it is the no-op span (then: a shared no-op).

    Unlike `trace.use_span`'s defaults, it records no exception and sets no status from one:
    an exception's text may quote a prompt, so callers record only its type (`error.type`).
    A sampled-out span still has a valid context and is activated, so that the decision to
    drop it propagates downstream.
    """
    if not span.get_span_context().is_valid:
        return _NO_SPAN
    return trace.use_span(span, record_exception=False, set_status_on_exception=False)
