"""Reply, stream and error bodies of the three wire formats the mock provider speaks.

The shapes follow the public API references closely enough that the official
SDKs parse them into their typed models; fields the SDKs mark as required are
always present, even where the mock has nothing meaningful to put in them.
"""

from __future__ import annotations

import base64
import hashlib
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from switchyard_mw.testing._tool_calls import (
    Offer,
    ToolCall,
    anthropic_offer,
    chat_offer,
    responses_offer,
)

ErrorStyle = Literal["anthropic", "openai"]

_encode = msgspec.json.Encoder().encode


@dataclass(frozen=True, slots=True)
class ReplyContext:
    model: str
    text: str
    parts: tuple[str, ...]
    input_tokens: int
    """Input tokens neither read from nor written to the prompt cache."""
    output_tokens: int
    # Chat Completions only sends a usage chunk when the caller asks for one.
    include_usage: bool = False
    calls: tuple[ToolCall, ...] = ()
    """Tool calls to answer with instead of text, or after it (`text_first`)."""
    text_first: bool = False
    """Whether an answer with tool calls says its text before them."""
    thought: str = ""
    """What the model thinks before it answers, when the request asks it to ("": no thinking).
    Anthropic shows it as a thinking block; OpenAI only counts its reasoning tokens."""
    thought_parts: tuple[str, ...] = ()
    reasoning_tokens: int = 0
    """Of `output_tokens`, those spent thinking."""
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0

    @property
    def says_text(self) -> bool:
        return self.text_first or not self.calls

    @property
    def prompt_tokens(self) -> int:
        """Every input token, cached or not: OpenAI's count (Anthropic's leaves cache out)."""
        return self.input_tokens + self.cache_read_tokens + self.cache_write_tokens


@dataclass(frozen=True, slots=True)
class StreamPlan:
    """SSE frames of one streamed reply.

    Split in three so the server can put stalls, gaps and faults between the deltas (of text,
    or of a tool call's arguments) while the framing around them stays exactly what the real
    API sends.
    """

    prelude: bytes
    deltas: tuple[bytes, ...]
    epilogue: bytes


@dataclass(frozen=True, slots=True)
class Block:
    """One content block (or output item, or tool call) of a stream: its opening frames, one
    frame per delta, and its closing frames."""

    opening: bytes
    deltas: tuple[bytes, ...]
    closing: bytes


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


def fold(blocks: Sequence[Block]) -> tuple[bytes, tuple[bytes, ...], bytes]:
    """Blocks as one opening, the deltas and one closing: a block's opening rides on its first
    delta and the closing before it on that too, so every stall and fault falls between two
    deltas, as in a one-block stream. Every block has at least one delta."""
    deltas: list[bytes] = []
    for before, block in zip((None, *blocks), blocks, strict=False):
        first, *rest = block.deltas
        if before is not None:
            first = before.closing + block.opening + first
        deltas += [first, *rest]
    return blocks[0].opening, tuple(deltas), blocks[-1].closing


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + _encode(data) + b"\n\n"


def _data(data: dict[str, Any]) -> bytes:
    return b"data: " + _encode(data) + b"\n\n"


# --- Anthropic Messages -----------------------------------------------------------------


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


def anthropic_thinks(request: dict[str, Any]) -> bool:
    thinking = request.get("thinking")
    return isinstance(thinking, dict) and thinking.get("type") in ("enabled", "adaptive")


def _tool_use(call: ToolCall, arguments: Any) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.call_id, "name": call.name, "input": arguments}


def _anthropic_stop(ctx: ReplyContext) -> str:
    return "tool_use" if ctx.calls else "end_turn"


def anthropic_reply(ctx: ReplyContext) -> bytes:
    return _encode(_anthropic_message(ctx, _new_id("msg_"), done=True))


def _anthropic_block(
    index: int, start: dict[str, Any], deltas: list[dict[str, Any]], last: bytes = b""
) -> Block:
    return Block(
        opening=_event(
            "content_block_start",
            {"type": "content_block_start", "index": index, "content_block": start},
        ),
        deltas=tuple(
            _event(
                "content_block_delta", {"type": "content_block_delta", "index": index, "delta": d}
            )
            for d in deltas
        ),
        closing=last + _event("content_block_stop", {"type": "content_block_stop", "index": index}),
    )


def anthropic_stream(ctx: ReplyContext) -> StreamPlan:
    start = _anthropic_message(ctx, _new_id("msg_"), done=False)
    blocks = []
    if ctx.thought:
        thoughts = [{"type": "thinking_delta", "thinking": p} for p in ctx.thought_parts]
        signed = {"type": "signature_delta", "signature": _signature(ctx.thought)}
        signature = _event(
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
        _event("message_start", {"type": "message_start", "message": start})
        + opening
        + _event("ping", {"type": "ping"})
    )
    epilogue = (
        closing
        + _event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": _anthropic_stop(ctx), "stop_sequence": None},
                # The API repeats the input and cache counts here, beside the output's.
                "usage": _anthropic_usage(ctx, ctx.output_tokens),
            },
        )
        + _event("message_stop", {"type": "message_stop"})
    )
    return StreamPlan(prelude, deltas, epilogue)


def anthropic_stream_error(_sequence: int, message: str) -> bytes:
    error = {"type": "overloaded_error", "message": message}
    return _event("error", {"type": "error", "error": error})


# --- OpenAI Chat Completions ------------------------------------------------------------


def _chat_usage(ctx: ReplyContext) -> dict[str, Any]:
    return {
        "prompt_tokens": ctx.prompt_tokens,
        "completion_tokens": ctx.output_tokens,
        "total_tokens": ctx.prompt_tokens + ctx.output_tokens,
        "prompt_tokens_details": {"cached_tokens": ctx.cache_read_tokens, "audio_tokens": 0},
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


def chat_reply(ctx: ReplyContext) -> bytes:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": ctx.text if ctx.says_text else None,
        "refusal": None,
        "annotations": [],
    }
    if ctx.calls:
        message["tool_calls"] = [_chat_call(call) for call in ctx.calls]
    return _encode(
        {
            "id": _new_id("chatcmpl-"),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": ctx.model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": "tool_calls" if ctx.calls else "stop",
                }
            ],
            "usage": _chat_usage(ctx),
            "service_tier": "default",
            "system_fingerprint": None,
        }
    )


def chat_stream(ctx: ReplyContext) -> StreamPlan:
    head: dict[str, Any] = {
        "id": _new_id("chatcmpl-"),
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
        return _data({**head, "choices": [choice]})

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
    epilogue = closing + chunk({}, "tool_calls" if ctx.calls else "stop")
    if ctx.include_usage:
        epilogue += _data({**head, "choices": [], "usage": _chat_usage(ctx)})
    return StreamPlan(prelude, deltas, epilogue + b"data: [DONE]\n\n")


def openai_chat_stream_error(_sequence: int, message: str) -> bytes:
    return _data(
        {"error": {"message": message, "type": "server_error", "param": None, "code": None}}
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


def _function_call(call: ToolCall, *, done: bool) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": call.item_id,
        "call_id": call.call_id,
        "name": call.name,
        "arguments": call.arguments if done else "",
        "status": "completed" if done else "in_progress",
    }


@dataclass(frozen=True, slots=True)
class _Ids:
    """A response's ids, the same in its events and its final form."""

    response: str = field(default_factory=lambda: _new_id("resp_"))
    message: str = field(default_factory=lambda: _new_id("msg_"))
    reasoning: str = field(default_factory=lambda: _new_id("rs_"))


def _reasoning(item_id: str) -> dict[str, Any]:
    # Without `reasoning.summary` or an `include` asking for it, the item says nothing more.
    return {"type": "reasoning", "id": item_id, "summary": []}


def responses_thinks(request: dict[str, Any]) -> bool:
    reasoning = request.get("reasoning")
    return isinstance(reasoning, dict) and reasoning.get("effort") not in ("none", "minimal")


def chat_thinks(request: dict[str, Any]) -> bool:
    effort = request.get("reasoning_effort")
    return isinstance(effort, str) and effort not in ("none", "minimal")


def _response(ctx: ReplyContext, ids: _Ids, *, done: bool) -> dict[str, Any]:
    usage = {
        "input_tokens": ctx.prompt_tokens,
        "input_tokens_details": {"cached_tokens": ctx.cache_read_tokens},
        "output_tokens": ctx.output_tokens,
        "output_tokens_details": {"reasoning_tokens": ctx.reasoning_tokens},
        "total_tokens": ctx.prompt_tokens + ctx.output_tokens,
    }
    output = [_reasoning(ids.reasoning)] if ctx.thought else []
    output += [_output_message(ctx, ids.message, done=True)] if ctx.says_text else []
    output += [_function_call(call, done=True) for call in ctx.calls]
    return {
        "id": ids.response,
        "object": "response",
        "created_at": int(time.time()),
        "status": "completed" if done else "in_progress",
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "model": ctx.model,
        "output": output if done else [],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": usage if done else None,
        "metadata": {},
    }


def responses_reply(ctx: ReplyContext) -> bytes:
    return _encode(_response(ctx, _Ids(), done=True))


class _Sequenced:
    """Responses events, numbered in the order they are made (which is the order they go)."""

    def __init__(self) -> None:
        self.next = 0

    def __call__(self, event: str, /, **fields: Any) -> bytes:
        frame = _event(event, {"type": event, "sequence_number": self.next, **fields})
        self.next += 1
        return frame


def _responses_text(ctx: ReplyContext, ev: _Sequenced, item_id: str, index: int) -> Block:
    where = {"item_id": item_id, "output_index": index, "content_index": 0}
    item = _output_message(ctx, item_id, done=False)
    return Block(
        opening=ev("response.output_item.added", output_index=index, item=item)
        + ev("response.content_part.added", **where, part=_output_text("")),
        deltas=tuple(
            ev("response.output_text.delta", **where, delta=p, logprobs=[]) for p in ctx.parts
        ),
        closing=ev("response.output_text.done", **where, text=ctx.text, logprobs=[])
        + ev("response.content_part.done", **where, part=_output_text(ctx.text))
        + ev(
            "response.output_item.done",
            output_index=index,
            item=_output_message(ctx, item_id, done=True),
        ),
    )


def _responses_call(call: ToolCall, index: int, ev: _Sequenced) -> Block:
    where = {"item_id": call.item_id, "output_index": index}
    opening = ev(
        "response.output_item.added", output_index=index, item=_function_call(call, done=False)
    )
    deltas = tuple(
        ev("response.function_call_arguments.delta", **where, delta=p) for p in call.pieces
    )
    closing = ev(
        "response.function_call_arguments.done", **where, name=call.name, arguments=call.arguments
    ) + ev("response.output_item.done", output_index=index, item=_function_call(call, done=True))
    return Block(opening, deltas, closing)


def responses_stream(ctx: ReplyContext) -> StreamPlan:
    ids = _Ids()
    ev = _Sequenced()
    pending = _response(ctx, ids, done=False)
    started = ev("response.created", response=pending) + ev(
        "response.in_progress", response=pending
    )
    index = 0
    if ctx.thought:  # a reasoning item without a summary has no deltas: it opens and closes
        item = _reasoning(ids.reasoning)
        started += ev("response.output_item.added", output_index=0, item=item)
        started += ev("response.output_item.done", output_index=0, item=item)
        index = 1
    # Built in stream order, so the sequence numbers run on across blocks.
    blocks = [_responses_text(ctx, ev, ids.message, index)] if ctx.says_text else []
    index += len(blocks)
    blocks += [_responses_call(call, i, ev) for i, call in enumerate(ctx.calls, start=index)]
    opening, deltas, closing = fold(blocks)
    completed = ev("response.completed", response=_response(ctx, ids, done=True))
    return StreamPlan(started + opening, deltas, closing + completed)


def responses_stream_error(sequence: int, message: str) -> bytes:
    fields = {"code": "server_error", "message": message, "param": None}
    return _event("error", {"type": "error", **fields, "sequence_number": sequence})


ENDPOINTS: dict[str, Endpoint] = {
    "/v1/messages": Endpoint(
        "anthropic",
        anthropic_reply,
        anthropic_stream,
        anthropic_offer,
        anthropic_stream_error,
        anthropic_thinks,
    ),
    "/v1/chat/completions": Endpoint(
        "openai", chat_reply, chat_stream, chat_offer, openai_chat_stream_error, chat_thinks
    ),
    "/v1/responses": Endpoint(
        "openai",
        responses_reply,
        responses_stream,
        responses_offer,
        responses_stream_error,
        responses_thinks,
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
        return _encode({"type": "error", "error": {"type": kind, "message": message}})
    return _encode({"error": {"message": message, "type": kind, "param": None, "code": kind}})
