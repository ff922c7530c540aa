"""What a provider's error answer says, read from its body (bounded, gzip or not).

Two refusals are told by their body alone, on every wire (Anthropic Messages, OpenAI Chat and
Responses; a cloud account's errors reach this in Anthropic's shape):

- a **context-length refusal** (`context_refusal`): a 400 saying the prompt is too long for
  the model (Anthropic's `invalid_request_error` "prompt is too long", OpenAI's
  `context_length_exceeded`); a fallback chain's `context_length` reason;
- a **billing refusal** (`billing_refusal`): the account's credit or quota is spent, which
  providers answer with a status that says something else: OpenAI's 429 whose error is
  `insufficient_quota`, Anthropic's 400 `invalid_request_error` "Your credit balance is too
  low". It is the account's credential fault (cooled for every model, no throttle hold),
  never a throttle or the client's error.
"""

from __future__ import annotations

import zlib

import msgspec

__all__ = ["MAX_BODY", "billing_refusal", "context_refusal"]

MAX_BODY = 64 * 1024
"""An error answer larger than this is read no further: no refusal above is that long."""
_GZIP = 16 + zlib.MAX_WBITS
_TOO_LONG = ("prompt is too long", "exceed context limit")
"""What Anthropic's refusals of an over-long prompt say (the prompt alone, or the prompt and
`max_tokens` together past the model's context window)."""
_NO_CREDIT = ("credit balance is too low",)
"""What Anthropic's refusal of an account without credit says (a 400 since 2024)."""
_NO_QUOTA = "insufficient_quota"
"""OpenAI's error code (and type) of an account whose quota or billing is spent (a 429)."""


class _Error(msgspec.Struct):
    type: str | None = None
    code: str | int | None = None
    message: str | None = None


class _Answer(msgspec.Struct):
    error: _Error | None = None


_decode = msgspec.json.Decoder(_Answer).decode


def _error_of(body: bytes) -> _Error | None:
    """The `error` object of an error answer (either wire's shape), or None."""
    if not body or len(body) > MAX_BODY:
        return None
    if body[:2] == b"\x1f\x8b":  # a gzip-encoded error answer, read no further than the bound
        try:
            body = zlib.decompressobj(_GZIP).decompress(body, MAX_BODY)
        except zlib.error:
            return None
    try:
        return _decode(body).error
    except msgspec.DecodeError:
        return None


def context_refusal(status: int, body: bytes) -> bool:
    """Whether an answer is a provider's context-length refusal (either wire's shape)."""
    if status != 400:
        return False
    error = _error_of(body)
    if error is None:
        return False
    if error.code == "context_length_exceeded":
        return True  # OpenAI, Chat and Responses
    message = (error.message or "").lower()
    return error.type == "invalid_request_error" and any(s in message for s in _TOO_LONG)


def billing_refusal(status: int, body: bytes) -> bool:
    """Whether an answer is a provider's refusal of the account's billing that arrives as a
    429 or a 400: OpenAI's `insufficient_quota` (code or type), Anthropic's "credit balance is
    too low" `invalid_request_error`."""
    if status not in (400, 429):
        return False
    error = _error_of(body)
    if error is None:
        return False
    if status == 429:
        return _NO_QUOTA in (error.code, error.type)
    message = (error.message or "").lower()
    return error.type == "invalid_request_error" and any(s in message for s in _NO_CREDIT)
