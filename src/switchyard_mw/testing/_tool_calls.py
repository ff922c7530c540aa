"""Which tools the mock calls, read from a request of any of the three wires.

The mock plays a model that always uses a tool it is offered, once, then answers: a request
that offers tools gets tool calls unless its last turn hands back tool results, in which case it
gets text, so a client's tool loop ends after one round. `tool_choice` is honoured as the real
APIs honour it: "none" never calls, a forced choice ("any"/"required", or one named tool) calls
even after a tool result, "auto" (or none given) calls only on a fresh user turn.

The arguments are an example of the tool's JSON schema (first enum value, "mock" for a string,
1 for a number, required properties of an object), or the behaviour's `tool_input` when set.
"""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec

_encode = msgspec.json.Encoder().encode
_MAX_DEPTH = 8
"""Deeper than this an example schema value is null: a self-referencing schema ends."""


class Choice(enum.Enum):
    NONE = "none"
    AUTO = "auto"
    FORCED = "forced"


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    schema: Any


@dataclass(frozen=True, slots=True)
class Offer:
    """What a request offers and asks: its tools, its tool_choice, and whether its last turn
    hands back tool results."""

    tools: tuple[Tool, ...] = ()
    choice: Choice = Choice.AUTO
    named: str | None = None
    after_tool_result: bool = False


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    call_id: str
    item_id: str
    """The Responses API's output item id (`fc_...`); the other wires only use `call_id`."""
    arguments: str
    """The arguments as the JSON text the wire carries."""
    pieces: tuple[str, ...]
    """`arguments` cut as a stream sends it, one piece a delta."""


def tool_calls(
    offer: Offer,
    *,
    vendor: str,
    count: int,
    pieces: int,
    tool_input: dict[str, Any] | None,
) -> tuple[ToolCall, ...]:
    """The calls to answer `offer` with (none: answer text)."""
    tools = _chosen(offer)
    if not tools:
        return ()
    calls = []
    for index in range(count):
        tool = tools[index % len(tools)]
        args = tool_input if tool_input is not None else example_of(tool.schema)
        text = _encode(args if isinstance(args, dict) else {}).decode()
        calls.append(
            ToolCall(
                name=tool.name,
                call_id=_new_id("toolu_" if vendor == "anthropic" else "call_"),
                item_id=_new_id("fc_"),
                arguments=text,
                pieces=split_text(text, pieces),
            )
        )
    return tuple(calls)


def _chosen(offer: Offer) -> tuple[Tool, ...]:
    if not offer.tools or offer.choice is Choice.NONE:
        return ()
    if offer.choice is Choice.AUTO and offer.after_tool_result:
        return ()
    if offer.named is not None:
        return tuple(t for t in offer.tools if t.name == offer.named)
    return offer.tools


def split_text(text: str, parts: int) -> tuple[str, ...]:
    """Split into `parts` contiguous pieces (fewer when the text is shorter)."""
    count = max(1, min(parts, len(text)))
    bounds = [len(text) * i // count for i in range(count + 1)]
    return tuple(text[bounds[i] : bounds[i + 1]] for i in range(count))


def example_of(schema: Any, depth: int = 0) -> Any:
    """A value that fits the JSON schema `schema`, the same one each time."""
    if not isinstance(schema, dict) or depth > _MAX_DEPTH:
        return None
    for key in ("const", "default"):
        if key in schema:
            return schema[key]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return example_of(schema[key][0], depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object" or (kind is None and "properties" in schema):
        return _example_object(schema, depth)
    if kind == "array":
        return [example_of(schema.get("items"), depth + 1)] if "items" in schema else []
    return _SCALARS.get(kind) if isinstance(kind, str) else None


_SCALARS: dict[str, Any] = {"string": "mock", "integer": 1, "number": 1, "boolean": True}


def _example_object(schema: dict[str, Any], depth: int) -> dict[str, Any]:
    props = schema.get("properties")
    if not isinstance(props, dict):
        return {}
    required = schema.get("required")
    names = [n for n in required if n in props] if isinstance(required, list) else list(props)
    return {name: example_of(props[name], depth + 1) for name in names}


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


# --- reading each wire's request ---------------------------------------------------------


def anthropic_offer(request: dict[str, Any]) -> Offer:
    tools = tuple(
        Tool(t["name"], t.get("input_schema"))
        for t in _dicts(request.get("tools"))
        # Server tools (web search, code execution...) are run by the provider, not the client.
        if isinstance(t.get("name"), str) and t.get("type", "custom") == "custom"
    )
    choice, named = Choice.AUTO, None
    wanted = request.get("tool_choice")
    if isinstance(wanted, dict):
        kind = wanted.get("type")
        if kind == "none":
            choice = Choice.NONE
        elif kind in ("any", "tool"):
            choice = Choice.FORCED
            named = wanted.get("name") if kind == "tool" else None
    turns = _dicts(request.get("messages"))
    last = turns[-1] if turns else {}
    results = any(b.get("type") == "tool_result" for b in _dicts(last.get("content")))
    return Offer(tools, choice, named, last.get("role") == "user" and results)


def chat_offer(request: dict[str, Any]) -> Offer:
    tools = tuple(
        Tool(f["name"], f.get("parameters"))
        for t in _dicts(request.get("tools"))
        if t.get("type") == "function"
        and isinstance(f := t.get("function"), dict)
        and isinstance(f.get("name"), str)
    )
    choice, named = _openai_choice(request.get("tool_choice"))
    if isinstance(request.get("tool_choice"), dict):
        function = request["tool_choice"].get("function")
        named = function.get("name") if isinstance(function, dict) else None
    turns = _dicts(request.get("messages"))
    after = bool(turns) and turns[-1].get("role") == "tool"
    return Offer(tools, choice, named, after)


def responses_offer(request: dict[str, Any]) -> Offer:
    tools = tuple(
        Tool(t["name"], t.get("parameters"))
        for t in _dicts(request.get("tools"))
        if t.get("type") == "function" and isinstance(t.get("name"), str)
    )
    choice, named = _openai_choice(request.get("tool_choice"))
    items = _dicts(request.get("input"))
    after = bool(items) and items[-1].get("type") == "function_call_output"
    return Offer(tools, choice, named, after)


def _openai_choice(wanted: Any) -> tuple[Choice, str | None]:
    if wanted == "none":
        return Choice.NONE, None
    if wanted == "required":
        return Choice.FORCED, None
    if isinstance(wanted, dict) and wanted.get("type") == "function":
        name = wanted.get("name")  # Responses; Chat nests it under "function"
        return Choice.FORCED, name if isinstance(name, str) else None
    return Choice.AUTO, None


def _dicts(value: Any) -> list[dict[str, Any]]:
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []
