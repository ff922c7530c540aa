"""Moving one request to its canary variant, and the telemetry that records it.

Shared by every transport (the ASGI variant policy, the ext_proc servicer), so a request is
split, counted and annotated the same way whoever serves it.
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import trace

from . import telemetry as tm
from .config import Canary
from .context import RequestContext
from .core.variants import Split


def build_splits(canaries: Mapping[str, Canary]) -> dict[str, Split]:
    """Each canaried model's bucket ranges, computed once at load."""
    return {
        model: Split.build(model, list(canary.variants.items()), canary.salt)
        for model, canary in canaries.items()
    }


def assign_variant(splits: Mapping[str, Split], ctx: RequestContext) -> None:
    """Move the request to its variant when its (resolved) model has a canary."""
    model, view = ctx.resolved_model, ctx.view
    split = splits.get(model) if model is not None else None
    if split is None or view is None:
        return
    # A user id decides alone: the first turn is hashed only when there is none.
    turn = None if view.user_key else view.first_turn_hash
    chosen, kind = split.choose(view.user_key, turn)
    ctx.resolved_model, ctx.variant, ctx.key_kind = chosen, chosen, kind
    tm.variant_assignments.add(split.base, chosen, kind)
    if view.user_key and tm.tracing() and (span := trace.get_current_span()).is_recording():
        span.set_attribute(tm.VARIANT_KEY_HASH, tm.short_hash(view.user_key))
