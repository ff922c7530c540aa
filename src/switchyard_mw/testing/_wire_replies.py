"""Reply, stream and error bodies of the three wire formats the mock provider speaks.

The shapes follow the public API references closely enough that the official
SDKs parse them into their typed models; fields the SDKs mark as required are
always present, even where the mock has nothing meaningful to put in them.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

ErrorStyle = Literal["anthropic", "openai"]

_encode = msgspec.json.Encoder().encode


@dataclass(frozen=True, slots=True)
class ReplyContext:
    model: str
    text: str
    parts: tuple[str, ...]
    input_tokens: int
    output_tokens: int
    # Chat Completions only sends a usage chunk when the caller asks for one.
    include_usage: bool = False


@dataclass(frozen=True, slots=True)
class StreamPlan:
    """SSE frames of one streamed reply.

    Split in three so the server can put stalls, gaps and faults between the text
    deltas while the framing around them stays exactly what the real API sends.
    """

    prelude: bytes
    deltas: tuple[bytes, ...]
    epilogue: bytes


@dataclass(frozen=True, slots=True)
class Endpoint:
    errors: ErrorStyle
    reply: Callable[[ReplyContext], bytes]
    stream: Callable[[ReplyContext], StreamPlan]


def split_text(text: str, parts: int) -> tuple[str, ...]:
    """Split into `parts` contiguous pieces (fewer when the text is shorter)."""
    count = max(1, min(parts, len(text)))
    bounds = [len(text) * i // count for i in range(count + 1)]
    return tuple(text[bounds[i] : bounds[i + 1]] for i in range(count))


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + _encode(data) + b"\n\n"


def _data(data: dict[str, Any]) -> bytes:
    return b"data: " + _encode(data) + b"\n\n"


# --- Anthropic Messages -----------------------------------------------------------------


def _anthropic_message(ctx: ReplyContext, msg_id: str, *, done: bool) -> dict[str, Any]:
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": ctx.model,
        "content": [{"type": "text", "text": ctx.text}] if done else [],
        "stop_reason": "end_turn" if done else None,
        "stop_sequence": None,
        "usage": {
            "input_tokens": ctx.input_tokens,
            "output_tokens": ctx.output_tokens if done else 1,
        },
    }


def anthropic_reply(ctx: ReplyContext) -> bytes:
    return _encode(_anthropic_message(ctx, _new_id("msg_"), done=True))


def anthropic_stream(ctx: ReplyContext) -> StreamPlan:
    start = _anthropic_message(ctx, _new_id("msg_"), done=False)
    prelude = (
        _event("message_start", {"type": "message_start", "message": start})
        + _event(
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
        )
        + _event("ping", {"type": "ping"})
    )
    deltas = tuple(
        _event(
            "content_block_delta",
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": p}},
        )
        for p in ctx.parts
    )
    epilogue = (
        _event("content_block_stop", {"type": "content_block_stop", "index": 0})
        + _event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                "usage": {"output_tokens": ctx.output_tokens},
            },
        )
        + _event("message_stop", {"type": "message_stop"})
    )
    return StreamPlan(prelude, deltas, epilogue)


# --- OpenAI Chat Completions ------------------------------------------------------------


def _chat_usage(ctx: ReplyContext) -> dict[str, int]:
    return {
        "prompt_tokens": ctx.input_tokens,
        "completion_tokens": ctx.output_tokens,
        "total_tokens": ctx.input_tokens + ctx.output_tokens,
    }


def chat_reply(ctx: ReplyContext) -> bytes:
    return _encode(
        {
            "id": _new_id("chatcmpl-"),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": ctx.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": ctx.text, "refusal": None},
                    "logprobs": None,
                    "finish_reason": "stop",
                }
            ],
            "usage": _chat_usage(ctx),
            "system_fingerprint": None,
        }
    )


def chat_stream(ctx: ReplyContext) -> StreamPlan:
    head = {
        "id": _new_id("chatcmpl-"),
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": ctx.model,
        "system_fingerprint": None,
    }

    def chunk(delta: dict[str, Any], finish: str | None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return _data({**head, "choices": [choice]})

    epilogue = chunk({}, "stop")
    if ctx.include_usage:
        epilogue += _data({**head, "choices": [], "usage": _chat_usage(ctx)})
    return StreamPlan(
        prelude=chunk({"role": "assistant", "content": ""}, None),
        deltas=tuple(chunk({"content": p}, None) for p in ctx.parts),
        epilogue=epilogue + b"data: [DONE]\n\n",
    )


# --- OpenAI Responses -------------------------------------------------------------------


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _output_message(ctx: ReplyContext, item_id: str, *, done: bool) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": "completed" if done else "in_progress",
        "role": "assistant",
        "content": [_output_text(ctx.text)] if done else [],
    }


def _response(ctx: ReplyContext, resp_id: str, item_id: str, *, done: bool) -> dict[str, Any]:
    usage = {
        "input_tokens": ctx.input_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": ctx.output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": ctx.input_tokens + ctx.output_tokens,
    }
    return {
        "id": resp_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "completed" if done else "in_progress",
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "model": ctx.model,
        "output": [_output_message(ctx, item_id, done=True)] if done else [],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": usage if done else None,
        "metadata": {},
    }


def responses_reply(ctx: ReplyContext) -> bytes:
    return _encode(_response(ctx, _new_id("resp_"), _new_id("msg_"), done=True))


def responses_stream(ctx: ReplyContext) -> StreamPlan:
    resp_id, item_id = _new_id("resp_"), _new_id("msg_")
    seq = 0

    def ev(name: str, **fields: Any) -> bytes:
        nonlocal seq
        frame = _event(name, {"type": name, "sequence_number": seq, **fields})
        seq += 1
        return frame

    where = {"item_id": item_id, "output_index": 0, "content_index": 0}
    pending = _response(ctx, resp_id, item_id, done=False)
    prelude = (
        ev("response.created", response=pending)
        + ev("response.in_progress", response=pending)
        + ev(
            "response.output_item.added",
            output_index=0,
            item=_output_message(ctx, item_id, done=False),
        )
        + ev("response.content_part.added", **where, part=_output_text(""))
    )
    deltas = tuple(
        ev("response.output_text.delta", **where, delta=p, logprobs=[]) for p in ctx.parts
    )
    epilogue = (
        ev("response.output_text.done", **where, text=ctx.text, logprobs=[])
        + ev("response.content_part.done", **where, part=_output_text(ctx.text))
        + ev(
            "response.output_item.done",
            output_index=0,
            item=_output_message(ctx, item_id, done=True),
        )
        + ev("response.completed", response=_response(ctx, resp_id, item_id, done=True))
    )
    return StreamPlan(prelude, deltas, epilogue)


ENDPOINTS: dict[str, Endpoint] = {
    "/v1/messages": Endpoint("anthropic", anthropic_reply, anthropic_stream),
    "/v1/chat/completions": Endpoint("openai", chat_reply, chat_stream),
    "/v1/responses": Endpoint("openai", responses_reply, responses_stream),
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
        return _encode({"type": "error", "error": {"type": kind, "message": message}})
    return _encode({"error": {"message": message, "type": kind, "param": None, "code": kind}})
