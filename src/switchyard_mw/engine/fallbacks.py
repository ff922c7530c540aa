"""Fallback chains at request time: the models a request may move to, and why.

`[fallbacks]` gives each model a chain of others, for one or more reasons: `unavailable`
(nothing of the model can serve: every account cooled, held by a 429, or failed in this
request), `context_length` (the provider refused the prompt as too long for the model) and
`budget` (the tenant's limit for the model is spent; only when a chain names it).
The attempt machine asks `after(model, reason)` for the models to try next, in order; a
model of a chain that has a chain of its own (for the same reason) brings it after, breadth
first (`core.chains.expand`). `check-config` refuses cycles, so the order is finite.

Whether a context-length refusal is one is read from the answer's body (`context_refusal`,
in `engine.error_bodies`): Anthropic's 400 `invalid_request_error` whose message says the
prompt is too long, OpenAI's 400 with code `context_length_exceeded` (Chat and Responses
alike).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from ..config import Fallback
from ..core.chains import expand
from . import error_bodies

__all__ = ["Chains", "Reason", "context_refusal"]


class Reason(enum.Enum):
    """Why a request moved to the next model of its chain (`x-switchyard-route:
    fallback:<value>`, the `reason` label of `switchyard.fallbacks`)."""

    UNAVAILABLE = "unavailable"
    CONTEXT_LENGTH = "context_length"
    BUDGET = "budget"
    """A limit of the model is spent for the request's tenant (`engine.tenancy` moves it, at
    admission, before any attempt)."""


class Chains:
    """The fallback chains of one config; a reload builds others (requests keep theirs)."""

    __slots__ = ("_after", "_by_reason")

    def __init__(self, fallbacks: Mapping[str, Fallback]) -> None:
        self._by_reason = {
            reason: {m: f.models for m, f in fallbacks.items() if reason.value in f.on}
            for reason in Reason
        }
        self._after: dict[tuple[str, Reason], tuple[str, ...]] = {}

    def __bool__(self) -> bool:
        return any(self._by_reason.values())

    def has(self, model: str, reason: Reason) -> bool:
        """Whether `model` has a chain for `reason`."""
        return model in self._by_reason[reason]

    def after(self, model: str, reason: Reason) -> tuple[str, ...]:
        """The models a request on `model` may move to for `reason`, in the order tried."""
        key = (model, reason)
        found = self._after.get(key)
        if found is None:
            # Bounded: one entry per configured model and reason (others have no chain).
            found = expand(self._by_reason[reason], model) if self.has(model, reason) else ()
            if found:
                self._after[key] = found
        return found


# Read from the refusal's body: `engine.error_bodies` (kept importable from here).
context_refusal = error_bodies.context_refusal
