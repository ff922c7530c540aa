"""OpenAI Responses answers: a response, or its numbered events (response.created ... output
items of reasoning, message and function_call ... response.completed with the usage)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

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


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _output_message(ctx: ReplyContext, item_id: str, *, done: bool) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": _status(ctx) if done else "in_progress",
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

    response: str = field(default_factory=lambda: new_id("resp_"))
    message: str = field(default_factory=lambda: new_id("msg_"))
    reasoning: str = field(default_factory=lambda: new_id("rs_"))


def _reasoning(item_id: str) -> dict[str, Any]:
    # Without `reasoning.summary` or an `include` asking for it, the item says nothing more.
    return {"type": "reasoning", "id": item_id, "summary": []}


def thinks(request: dict[str, Any]) -> bool:
    reasoning = request.get("reasoning")
    return isinstance(reasoning, dict) and reasoning.get("effort") not in ("none", "minimal")


def _response(ctx: ReplyContext, ids: _Ids, *, done: bool) -> dict[str, Any]:
    usage = {
        "input_tokens": ctx.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": ctx.cache_read_tokens,
            "cache_write_tokens": ctx.cache_write_tokens,
        },
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
        "status": _status(ctx) if done else "in_progress",
        "error": None,
        "incomplete_details": _incomplete(ctx) if done else None,
        "instructions": None,
        "model": ctx.model,
        "output": output if done else [],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": usage if done else None,
        "metadata": {},
    }


def _status(ctx: ReplyContext) -> str:
    return "incomplete" if ctx.cut_short or ctx.refused else "completed"


def _incomplete(ctx: ReplyContext) -> dict[str, str] | None:
    if ctx.refused:
        return {"reason": "content_filter"}
    return {"reason": "max_output_tokens"} if ctx.cut_short else None


def reply(ctx: ReplyContext) -> bytes:
    return encode(_response(ctx, _Ids(), done=True))


class _Sequenced:
    """Responses events, numbered in the order they are made (which is the order they go)."""

    def __init__(self) -> None:
        self.next = 0

    def __call__(self, name: str, /, **fields: Any) -> bytes:
        frame = event(name, {"type": name, "sequence_number": self.next, **fields})
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


def stream(ctx: ReplyContext) -> StreamPlan:
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
    # An answer cut at max_output_tokens ends with response.incomplete, its usage inside.
    ending = "response.incomplete" if ctx.cut_short or ctx.refused else "response.completed"
    completed = ev(ending, response=_response(ctx, ids, done=True))
    return StreamPlan(started + opening, deltas, closing + completed)


def stream_error(sequence: int, message: str) -> bytes:
    fields = {"code": "server_error", "message": message, "param": None}
    return event("error", {"type": "error", **fields, "sequence_number": sequence})
