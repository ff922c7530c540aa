"""Anthropic Messages answers: a message, or its event stream (message_start, content blocks of
thinking, text and tool_use, message_delta with the usage, message_stop)."""

from __future__ import annotations

import base64
import hashlib
from typing import Any

import msgspec

from switchyard_mw.testing._replies import (
    Block,
    ReplyContext,
    StreamPlan,
    encode,
    event,
    fold,
    new_id,
)
from switchyard_mw.testing._tool_calls import ToolCall


def _anthropic_usage(ctx: ReplyContext, output_tokens: int) -> dict[str, Any]:
    # As message_delta carries it; message_start and a whole message add the rest below.
    return {
        "input_tokens": ctx.input_tokens,
        "cache_creation_input_tokens": ctx.cache_write_tokens,
        "cache_read_input_tokens": ctx.cache_read_tokens,
        "output_tokens": output_tokens,
    }


def _anthropic_message(ctx: ReplyContext, msg_id: str, *, done: bool) -> dict[str, Any]:
    usage = {
        **_anthropic_usage(ctx, ctx.output_tokens if done else 1),
        "cache_creation": {
            "ephemeral_5m_input_tokens": ctx.cache_write_tokens,
            "ephemeral_1h_input_tokens": 0,
        },
        "server_tool_use": None,
        "service_tier": "standard",
    }
    content = [_thinking(ctx.thought)] if ctx.thought else []
    content += [{"type": "text", "text": ctx.text}] if ctx.says_text else []
    content += [_tool_use(call, msgspec.json.decode(call.arguments)) for call in ctx.calls]
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": ctx.model,
        "content": content if done else [],
        "stop_reason": _anthropic_stop(ctx) if done else None,
        "stop_sequence": None,
        "usage": usage,
    }


def _thinking(thought: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": thought, "signature": _signature(thought)}


def _signature(thought: str) -> str:
    # Opaque to clients, which send it back with the block: any base64 will do.
    return base64.b64encode(hashlib.sha256(thought.encode()).digest()).decode()


def thinks(request: dict[str, Any]) -> bool:
    thinking = request.get("thinking")
    return isinstance(thinking, dict) and thinking.get("type") in ("enabled", "adaptive")


def _tool_use(call: ToolCall, arguments: Any) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.call_id, "name": call.name, "input": arguments}


def _anthropic_stop(ctx: ReplyContext) -> str:
    if ctx.refused:
        return "refusal"
    if ctx.cut_short:
        return "max_tokens"
    return "tool_use" if ctx.calls else "end_turn"


def reply(ctx: ReplyContext) -> bytes:
    return encode(_anthropic_message(ctx, new_id("msg_"), done=True))


def _anthropic_block(
    index: int, start: dict[str, Any], deltas: list[dict[str, Any]], last: bytes = b""
) -> Block:
    return Block(
        opening=event(
            "content_block_start",
            {"type": "content_block_start", "index": index, "content_block": start},
        ),
        deltas=tuple(
            event(
                "content_block_delta", {"type": "content_block_delta", "index": index, "delta": d}
            )
            for d in deltas
        ),
        closing=last + event("content_block_stop", {"type": "content_block_stop", "index": index}),
    )


def stream(ctx: ReplyContext) -> StreamPlan:
    start = _anthropic_message(ctx, new_id("msg_"), done=False)
    blocks = []
    if ctx.thought:
        thoughts = [{"type": "thinking_delta", "thinking": p} for p in ctx.thought_parts]
        signed = {"type": "signature_delta", "signature": _signature(ctx.thought)}
        signature = event(
            "content_block_delta", {"type": "content_block_delta", "index": 0, "delta": signed}
        )
        blocks.append(_anthropic_block(0, _thinking("") | {"signature": ""}, thoughts, signature))
    if ctx.says_text:
        texts = [{"type": "text_delta", "text": p} for p in ctx.parts]
        blocks.append(_anthropic_block(len(blocks), {"type": "text", "text": ""}, texts))
    blocks += [
        _anthropic_block(
            index,
            _tool_use(call, {}),
            [{"type": "input_json_delta", "partial_json": p} for p in call.pieces],
        )
        for index, call in enumerate(ctx.calls, start=len(blocks))
    ]
    opening, deltas, closing = fold(blocks)
    prelude = (
        event("message_start", {"type": "message_start", "message": start})
        + opening
        + event("ping", {"type": "ping"})
    )
    epilogue = (
        closing
        + event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": _anthropic_stop(ctx), "stop_sequence": None},
                # The API repeats the input and cache counts here, beside the output's.
                "usage": _anthropic_usage(ctx, ctx.output_tokens),
            },
        )
        + event("message_stop", {"type": "message_stop"})
    )
    return StreamPlan(prelude, deltas, epilogue)


def stream_error(_sequence: int, message: str) -> bytes:
    error = {"type": "overloaded_error", "message": message}
    return event("error", {"type": "error", "error": error})
