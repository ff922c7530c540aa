"""OpenAI Chat Completions answers: a completion, or its chunks (a usage chunk last when the
caller asked for one with `stream_options.include_usage`)."""

from __future__ import annotations

import time
from typing import Any

from switchyard_mw.testing._replies import (
    Block,
    ReplyContext,
    StreamPlan,
    data,
    encode,
    fold,
    new_id,
)
from switchyard_mw.testing._tool_calls import ToolCall


def _chat_usage(ctx: ReplyContext) -> dict[str, Any]:
    return {
        "prompt_tokens": ctx.prompt_tokens,
        "completion_tokens": ctx.output_tokens,
        "total_tokens": ctx.prompt_tokens + ctx.output_tokens,
        "prompt_tokens_details": {
            "cached_tokens": ctx.cache_read_tokens,
            "cache_write_tokens": ctx.cache_write_tokens,
            "audio_tokens": 0,
        },
        "completion_tokens_details": {
            "reasoning_tokens": ctx.reasoning_tokens,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


def _chat_call(
    call: ToolCall, index: int | None = None, *, arguments: str | None = None
) -> dict[str, Any]:
    function = {"name": call.name, "arguments": call.arguments if arguments is None else arguments}
    found = {"id": call.call_id, "type": "function", "function": function}
    # A whole answer lists its calls; a stream's pieces say which call they continue.
    return found if index is None else {"index": index, **found}


def reply(ctx: ReplyContext) -> bytes:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": ctx.text if ctx.says_text else None,
        "refusal": None,
        "annotations": [],
    }
    if ctx.calls:
        message["tool_calls"] = [_chat_call(call) for call in ctx.calls]
    return encode(
        {
            "id": new_id("chatcmpl-"),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": ctx.model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": _finish(ctx),
                }
            ],
            "usage": _chat_usage(ctx),
            "service_tier": "default",
            "system_fingerprint": None,
        }
    )


def stream(ctx: ReplyContext) -> StreamPlan:
    head: dict[str, Any] = {
        "id": new_id("chatcmpl-"),
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": ctx.model,
        "service_tier": "default",
        "system_fingerprint": None,
    }
    if ctx.include_usage:
        head["usage"] = None  # on every chunk but the last, once the caller asked for usage

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return data({**head, "choices": [choice]})

    role = {"role": "assistant", "content": "" if ctx.says_text else None, "refusal": None}
    blocks = []
    if ctx.says_text:
        blocks.append(Block(chunk(role), tuple(chunk({"content": p}) for p in ctx.parts), b""))
    for index, call in enumerate(ctx.calls):
        # The first chunk of a call names it (and opens the message, when no text did); the
        # ones after carry its arguments' pieces.
        named = {"tool_calls": [_chat_call(call, index, arguments="")]}
        blocks.append(
            Block(
                opening=chunk({**role, **named} if not blocks else named),
                deltas=tuple(
                    chunk({"tool_calls": [{"index": index, "function": {"arguments": p}}]})
                    for p in call.pieces
                ),
                closing=b"",
            )
        )
    prelude, deltas, closing = fold(blocks)
    epilogue = closing + chunk({}, _finish(ctx))
    if ctx.include_usage:
        epilogue += data({**head, "choices": [], "usage": _chat_usage(ctx)})
    return StreamPlan(prelude, deltas, epilogue + b"data: [DONE]\n\n")


def _finish(ctx: ReplyContext) -> str:
    if ctx.refused:
        return "content_filter"
    if ctx.cut_short:
        return "length"
    return "tool_calls" if ctx.calls else "stop"


def stream_error(_sequence: int, message: str) -> bytes:
    return data(
        {"error": {"message": message, "type": "server_error", "param": None, "code": None}}
    )


def thinks(request: dict[str, Any]) -> bool:
    effort = request.get("reasoning_effort")
    return isinstance(effort, str) and effort not in ("none", "minimal")
