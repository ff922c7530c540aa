"""Fallback chains at request time: the models a request may move to, and why.

`[fallbacks]` gives each model a chain of others, for one or both reasons: `unavailable`
(nothing of the model can serve: every account cooled, held by a 429, or failed in this
request) and `context_length` (the provider refused the prompt as too long for the model).
The attempt machine asks `after(model, reason)` for the models to try next, in order; a
model of a chain that has a chain of its own (for the same reason) brings it after, breadth
first (`core.chains.expand`). `check-config` refuses cycles, so the order is finite.

Whether a context-length refusal is one is read from the answer's body (`context_refusal`):
Anthropic's 400 `invalid_request_error` whose message says the prompt is too long, OpenAI's
400 with code `context_length_exceeded` (Chat and Responses alike).
"""

from __future__ import annotations

import enum
import zlib
from collections.abc import Mapping

import msgspec

from ..config import Fallback
from ..core.chains import expand

__all__ = ["Chains", "Reason", "context_refusal"]


class Reason(enum.Enum):
    """Why a request moved to the next model of its chain (`x-switchyard-route:
    fallback:<value>`, the `reason` label of `switchyard.fallbacks`)."""

    UNAVAILABLE = "unavailable"
    CONTEXT_LENGTH = "context_length"


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


_CONTEXT_STATUS = 400
_MAX_BODY = 64 * 1024
"""An error answer larger than this is no context-length refusal worth reading."""
_GZIP = 16 + zlib.MAX_WBITS
_TOO_LONG = ("prompt is too long", "exceed context limit")
"""What Anthropic's refusals of an over-long prompt say (the prompt alone, or the prompt and
`max_tokens` together past the model's context window)."""


class _Error(msgspec.Struct):
    type: str | None = None
    code: str | int | None = None
    message: str | None = None


class _Answer(msgspec.Struct):
    error: _Error | None = None


_decode = msgspec.json.Decoder(_Answer).decode


def context_refusal(status: int, body: bytes) -> bool:
    """Whether an answer is a provider's context-length refusal (either wire's shape)."""
    if status != _CONTEXT_STATUS or not body or len(body) > _MAX_BODY:
        return False
    if body[:2] == b"\x1f\x8b":  # a gzip-encoded error answer, read no further than the bound
        try:
            body = zlib.decompressobj(_GZIP).decompress(body, _MAX_BODY)
        except zlib.error:
            return False
    try:
        error = _decode(body).error
    except msgspec.DecodeError:
        return False
    if error is None:
        return False
    if error.code == "context_length_exceeded":
        return True  # OpenAI, Chat and Responses
    message = (error.message or "").lower()
    return error.type == "invalid_request_error" and any(s in message for s in _TOO_LONG)
