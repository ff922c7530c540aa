"""A two-turn tool loop on each wire, driven with the official SDKs as a user's agent drives it:
the model asks for a tool, the client runs it and answers with the result, the model answers
text. Shared by the loops through the example gateway (`examples/test_tool_loop_live.py`) and
through Envoy (`extproc/test_tool_loop_envoy.py`); the mock provider is the model.

Streams are read with each SDK's own streaming helper, so a tool call counts as intact only if
the helper could put its pieces back together.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import anthropic
import openai

from switchyard_mw.testing import Behaviour

TOOL = "get_weather"
QUESTION = "What is the weather in Zürich?"
RESULT = "12 °C, clear skies"
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "query": {"type": "string"},
        "days": {"type": "array", "items": {"type": ["number", "null"]}},
        "nested": {"type": "object", "properties": {"ok": {"type": "boolean"}}},
    },
    "required": ["city", "query", "days", "nested"],
    "additionalProperties": False,
}
TOOL_INPUT: dict[str, Any] = {
    # Quotes, a backslash and characters of 2, 3 and 4 UTF-8 bytes: a stream cut anywhere
    # inside them must still join into the same arguments.
    "city": "Zürich",
    "query": 'a "quoted" word, a \\ backslash, 日本語 and 🙂',
    "days": [1, 2.5, None],
    "nested": {"ok": True},
}
WIRES = ("anthropic", "chat", "responses")
ANSWER = "It is 12 °C."


def model_behaviour(*, stream: bool) -> Behaviour:
    """The mock's behaviour for a loop: arguments cut in nine pieces, cache counts in usage,
    and in streams a sentence before the call (two blocks of different kinds in one stream);
    JSON answers are the call alone."""
    return Behaviour(
        tool_input=TOOL_INPUT,
        chunks=9,
        reply=ANSWER,
        text_before_tools=stream,
        cache_read_tokens=300,
        cache_write_tokens=40,
    )


@dataclass(frozen=True)
class Call:
    name: str
    id: str
    arguments: Any


@dataclass(frozen=True)
class Turn:
    """One answer's usage as the SDK read it, in the GenAI terms the request metrics use
    (input counts cached tokens too), and the cached tokens it reported read."""

    input: int
    output: int
    cache_read: int


@dataclass(frozen=True)
class Loop:
    said_first: str
    """The text the model said beside its tool call ("" for none)."""
    call: Call
    answer: str
    turns: tuple[Turn, Turn]


async def run_loop(wire: str, base_url: str, model: str, *, stream: bool) -> Loop:
    if wire == "anthropic":
        async with anthropic.AsyncAnthropic(
            base_url=base_url, api_key="caller", max_retries=0
        ) as claude:
            return await anthropic_loop(claude, model, stream=stream)
    async with openai.AsyncOpenAI(
        base_url=f"{base_url}/v1", api_key="caller", max_retries=0
    ) as gpt:
        if wire == "chat":
            return await chat_loop(gpt, model, stream=stream)
        return await responses_loop(gpt, model, stream=stream)


# --- Anthropic Messages -------------------------------------------------------------------


async def anthropic_loop(client: anthropic.AsyncAnthropic, model: str, *, stream: bool) -> Loop:
    tools: Any = [{"name": TOOL, "description": "The weather in a city.", "input_schema": SCHEMA}]
    turns: Any = [{"role": "user", "content": QUESTION}]
    first = await _anthropic_turn(client, model, turns, tools, stream=stream)
    assert first.stop_reason == "tool_use"
    (use,) = [block for block in first.content if block.type == "tool_use"]
    turns += [
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}],
        },
    ]
    second = await _anthropic_turn(client, model, turns, tools, stream=stream)
    assert second.stop_reason == "end_turn"
    return Loop(
        _claude_text(first),
        Call(use.name, use.id, use.input),
        _claude_text(second),
        (_claude_turn(first), _claude_turn(second)),
    )


def _claude_text(message: anthropic.types.Message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


async def _anthropic_turn(
    client: anthropic.AsyncAnthropic, model: str, turns: Any, tools: Any, *, stream: bool
) -> anthropic.types.Message:
    if not stream:
        return await client.messages.create(
            model=model, max_tokens=500, messages=turns, tools=tools
        )
    async with client.messages.stream(
        model=model, max_tokens=500, messages=turns, tools=tools
    ) as events:
        return await events.get_final_message()


def _claude_turn(message: anthropic.types.Message) -> Turn:
    usage = message.usage
    read = usage.cache_read_input_tokens or 0
    written = usage.cache_creation_input_tokens or 0
    return Turn(usage.input_tokens + read + written, usage.output_tokens, read)


# --- OpenAI Chat Completions --------------------------------------------------------------


async def chat_loop(client: openai.AsyncOpenAI, model: str, *, stream: bool) -> Loop:
    # strict: the SDK's streaming helper only takes tools whose arguments it can parse.
    function = {"name": TOOL, "description": "The weather.", "parameters": SCHEMA, "strict": True}
    tools: Any = [{"type": "function", "function": function}]
    turns: Any = [{"role": "user", "content": QUESTION}]
    first = await _chat_turn(client, model, turns, tools, stream=stream)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (called,) = choice.message.tool_calls or []
    assert called.type == "function"
    turns += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": called.id, "content": RESULT},
    ]
    second = await _chat_turn(client, model, turns, tools, stream=stream)
    assert second.choices[0].finish_reason == "stop"
    call = Call(called.function.name, called.id, json.loads(called.function.arguments))
    answer = second.choices[0].message.content or ""
    said = choice.message.content or ""
    return Loop(said, call, answer, (_gpt_turn(first), _gpt_turn(second)))


async def _chat_turn(
    client: openai.AsyncOpenAI, model: str, turns: Any, tools: Any, *, stream: bool
) -> openai.types.chat.ChatCompletion:
    if not stream:
        return await client.chat.completions.create(model=model, messages=turns, tools=tools)
    async with client.chat.completions.stream(
        model=model, messages=turns, tools=tools, stream_options={"include_usage": True}
    ) as events:
        final = await events.get_final_completion()
    for called in final.choices[0].message.tool_calls or []:
        # The helper parsed the joined pieces itself: they agree with the raw text.
        assert called.function.parsed_arguments == json.loads(called.function.arguments)
    return final


def _gpt_turn(completion: openai.types.chat.ChatCompletion) -> Turn:
    usage = completion.usage
    assert usage is not None
    details = usage.prompt_tokens_details
    cached = details.cached_tokens if details is not None else None
    return Turn(usage.prompt_tokens, usage.completion_tokens, cached or 0)


# --- OpenAI Responses ---------------------------------------------------------------------


async def responses_loop(client: openai.AsyncOpenAI, model: str, *, stream: bool) -> Loop:
    tools: Any = [
        {"type": "function", "name": TOOL, "parameters": SCHEMA, "strict": True},
    ]
    items: Any = [{"role": "user", "content": QUESTION}]
    first = await _responses_turn(client, model, items, tools, stream=stream)
    (called,) = [item for item in first.output if item.type == "function_call"]
    items += [
        *(item.model_dump(exclude_none=True) for item in first.output),
        {"type": "function_call_output", "call_id": called.call_id, "output": RESULT},
    ]
    second = await _responses_turn(client, model, items, tools, stream=stream)
    assert not [item for item in second.output if item.type == "function_call"]
    call = Call(called.name, called.call_id, json.loads(called.arguments))
    turns = (_responses_usage(first), _responses_usage(second))
    return Loop(first.output_text, call, second.output_text, turns)


async def _responses_turn(
    client: openai.AsyncOpenAI, model: str, items: Any, tools: Any, *, stream: bool
) -> openai.types.responses.Response:
    if not stream:
        return await client.responses.create(model=model, input=items, tools=tools)
    async with client.responses.stream(model=model, input=items, tools=tools) as events:
        seen = [event.type async for event in events]
        final = await events.get_final_response()
    if any(item.type == "function_call" for item in final.output):
        assert "response.function_call_arguments.done" in seen, seen
    return final


def _responses_usage(response: openai.types.responses.Response) -> Turn:
    usage = response.usage
    assert usage is not None
    return Turn(usage.input_tokens, usage.output_tokens, usage.input_tokens_details.cached_tokens)
