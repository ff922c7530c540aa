"""Every telemetry name switchyard emits, and the tracer and instruments that emit them.

Names here are a contract (dashboards and alerts are built on them): change none lightly.
Without an OpenTelemetry SDK configured, every call below is the API's no-op.
"""

from __future__ import annotations

import hashlib
from importlib.metadata import version

from opentelemetry import metrics, trace

__version__ = version("switchyard-mw")

SCOPE = "switchyard_mw"

# Metric names.
CLASSIFIER_FAIL_OPEN = "switchyard.classifier_fail_open"
ACCOUNT_FAULTS = "switchyard.account.faults"
ACCOUNT_COOLED = "switchyard.account.cooled"
FAILOVERS = "switchyard.failovers"
DEADLINE_EXCEEDED = "switchyard.deadline.exceeded"
VARIANT_ASSIGNMENTS = "switchyard.variant.assignments"
JUDGE_DURATION = "switchyard.judge.duration"
BUDGET_INVALID = "switchyard.budget.invalid"
STATE_DEGRADED = "switchyard.state.degraded"

# Span names.
SPAN_REQUEST = "switchyard.request"
SPAN_JUDGE = "switchyard.judge"
SPAN_ATTEMPT = "switchyard.attempt"

# Attribute names (OpenTelemetry GenAI conventions where they exist).
REQUEST_MODEL = "gen_ai.request.model"
RESPONSE_MODEL = "gen_ai.response.model"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
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
JUDGE_ROUTE = "switchyard.judge.route"
JUDGE_OUTCOME = "switchyard.judge.outcome"
JUDGE_LABEL = "switchyard.judge.label"
JUDGE_REASON = "switchyard.judge.reason"

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
failovers = meter.create_counter(
    FAILOVERS, unit="{attempt}", description="Attempts moved to another account"
)
deadline_exceeded = meter.create_counter(
    DEADLINE_EXCEEDED, unit="{request}", description="Deadlines that expired, by phase"
)
variant_assignments = meter.create_counter(
    VARIANT_ASSIGNMENTS, unit="{request}", description="Canary decisions, by variant and key kind"
)
judge_duration = meter.create_histogram(
    JUDGE_DURATION, unit="s", description="Time spent consulting the judge"
)
budget_invalid = meter.create_counter(
    BUDGET_INVALID, unit="{request}", description="Budget headers ignored as invalid"
)
state_degraded = meter.create_counter(
    STATE_DEGRADED, unit="{event}", description="Times the shared state store was unreachable"
)


def short_hash(value: str) -> str:
    """A user key as telemetry may show it: 12 hex digits, never the key itself."""
    return hashlib.blake2b(value.encode(), digest_size=6).hexdigest()
