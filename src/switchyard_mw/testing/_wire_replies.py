"""The three wire formats the mock provider speaks: each endpoint's answers, and the error bodies.

The shapes follow the public API references closely enough that the official
SDKs parse them into their typed models; fields the SDKs mark as required are
always present, even where the mock has nothing meaningful to put in them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from switchyard_mw.testing import _anthropic_replies as anthropic
from switchyard_mw.testing import _chat_replies as chat
from switchyard_mw.testing import _responses_replies as responses
from switchyard_mw.testing._prefill import anthropic_prefill, chat_prefill, responses_prefill
from switchyard_mw.testing._replies import ReplyContext, StreamPlan, encode
from switchyard_mw.testing._tool_calls import (
    Offer,
    anthropic_offer,
    chat_offer,
    responses_offer,
)

ErrorStyle = Literal["anthropic", "openai"]


@dataclass(frozen=True, slots=True)
class Endpoint:
    errors: ErrorStyle
    reply: Callable[[ReplyContext], bytes]
    stream: Callable[[ReplyContext], StreamPlan]
    offer: Callable[[dict[str, Any]], Offer]
    """What the request offers in tools, read in this wire's terms."""
    stream_error: Callable[[int, str], bytes]
    """The wire's in-stream error event, given its sequence number and a message."""
    thinks: Callable[[dict[str, Any]], bool]
    """Whether the request asks the model to think (reason) before it answers."""
    caps: tuple[str, ...]
    """The request fields that cap the answer's output tokens, first found wins."""
    prefill: Callable[[dict[str, Any]], str]
    """The text of the assistant's own last turn, which the answer continues ("": none)."""


ENDPOINTS: dict[str, Endpoint] = {
    "/v1/messages": Endpoint(
        "anthropic",
        anthropic.reply,
        anthropic.stream,
        anthropic_offer,
        anthropic.stream_error,
        anthropic.thinks,
        ("max_tokens",),
        anthropic_prefill,
    ),
    "/v1/chat/completions": Endpoint(
        "openai",
        chat.reply,
        chat.stream,
        chat_offer,
        chat.stream_error,
        chat.thinks,
        ("max_completion_tokens", "max_tokens"),
        chat_prefill,
    ),
    "/v1/responses": Endpoint(
        "openai",
        responses.reply,
        responses.stream,
        responses_offer,
        responses.stream_error,
        responses.thinks,
        ("max_output_tokens",),
        responses_prefill,
    ),
}


# --- Errors -----------------------------------------------------------------------------

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(style: ErrorStyle, status: int, message: str) -> bytes:
    kind = error_type(status)
    if style == "anthropic":
        return encode({"type": "error", "error": {"type": kind, "message": message}})
    return encode({"error": {"message": message, "type": kind, "param": None, "code": kind}})


def context_length_body(path: str, prompt_tokens: int) -> bytes:
    """The 400 each API answers a prompt too long for the model with, in its own shape: what
    the official SDKs raise as their `BadRequestError` (`path`: the wire's, as ENDPOINTS)."""
    if path == "/v1/messages":
        message = f"prompt is too long: {prompt_tokens} tokens > 200000 maximum"
        return encode(
            {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
        )
    if path == "/v1/responses":
        message = (
            "Your input exceeds the context window of this model. "
            "Please adjust your input and try again."
        )
        param = "input"
    else:
        message = (
            "This model's maximum context length is 128000 tokens. However, your messages "
            f"resulted in {prompt_tokens} tokens. Please reduce the length of the messages."
        )
        param = "messages"
    error = {
        "message": message,
        "type": "invalid_request_error",
        "param": param,
        "code": "context_length_exceeded",
    }
    return encode({"error": error})


BILLING_ANTHROPIC = (
    "Your credit balance is too low to access the Anthropic API. Please go to Plans & Billing "
    "to upgrade or purchase credits."
)
BILLING_OPENAI = (
    "You exceeded your current quota, please check your plan and billing details. For more "
    "information on this error, read the docs: "
    "https://platform.openai.com/docs/guides/error-codes/api-errors."
)


def billing_body(path: str) -> tuple[int, bytes]:
    """The refusal each API answers an account without credit or quota with, as it sends it
    (`path`: the wire's, as ENDPOINTS): Anthropic's 400 `invalid_request_error` "Your credit
    balance is too low", OpenAI's 429 `insufficient_quota` (Chat and Responses)."""
    if path == "/v1/messages":
        refusal = {"type": "invalid_request_error", "message": BILLING_ANTHROPIC}
        return 400, encode({"type": "error", "error": refusal})
    error: dict[str, str | None] = {
        "message": BILLING_OPENAI,
        "type": "insufficient_quota",
        "param": None,
        "code": "insufficient_quota",
    }
    return 429, encode({"error": error})
