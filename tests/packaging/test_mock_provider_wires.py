"""The mock provider's tool calls, usage, request ids, compressed answers and in-stream errors,
read by the official SDKs.

Every answer is parsed into the SDK's typed objects and, for streams, put back together by the
SDK's own streaming helper: a field the mock leaves out, misnames or sends in the wrong event
shows up as a missing value here, as it would in a user's agent.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import AsyncIterable, Iterator
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pydantic
import pytest

from servers import serve_in_thread
from switchyard_mw.testing import DEFAULT_REPLY, Behaviour, MockProvider
from switchyard_mw.testing._tool_calls import example_of
from switchyard_mw.testing.mock_provider import THOUGHT

QUESTION: Any = [{"role": "user", "content": "Weather in Oslo?"}]
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Oslo", "Paris"]},
        "unit": {"type": "string"},
        "days": {"type": "integer"},
        "hourly": {"type": "boolean"},
        "note": {"type": "string"},
    },
    "required": ["city", "unit", "days", "hourly"],
}
EXAMPLE = {"city": "Oslo", "unit": "mock", "days": 1, "hourly": True}
CLAUDE_TOOLS: Any = [
    {"name": "get_weather", "input_schema": SCHEMA},
    {"name": "get_time", "input_schema": {"type": "object", "properties": {}}},
]
CHAT_TOOLS: Any = [
    {"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"]}}
    for t in CLAUDE_TOOLS
]
RESPONSES_TOOLS: Any = [
    {"type": "function", "name": t["name"], "parameters": t["input_schema"], "strict": False}
    for t in CLAUDE_TOOLS
]


@pytest.fixture
def mock() -> MockProvider:
    return MockProvider()


def claude(mock: MockProvider) -> anthropic.AsyncAnthropic:
    http = anthropic.DefaultAsyncHttpxClient(transport=httpx2.ASGITransport(app=mock))
    return anthropic.AsyncAnthropic(
        api_key="k", base_url="http://mock.test", max_retries=0, http_client=http
    )


def gpt(mock: MockProvider, base_url: str = "http://mock.test") -> openai.AsyncOpenAI:
    http = None
    if base_url == "http://mock.test":
        http = openai.DefaultAsyncHttpxClient(transport=httpx2.ASGITransport(app=mock))
    return openai.AsyncOpenAI(
        api_key="k", base_url=base_url + "/v1", max_retries=0, http_client=http
    )


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[MockProvider, str]]:
    app = MockProvider()
    with serve_in_thread(app) as url:
        yield app, url


@pytest.fixture
def tcp(served: tuple[MockProvider, str]) -> Iterator[tuple[MockProvider, str]]:
    served[0].reset()
    yield served
    served[0].reset()


async def collect(stream: AsyncIterable[Any], into: list[Any]) -> None:
    async for item in stream:
        into.append(item)


# --- when the mock calls a tool, and with what --------------------------------------------


@pytest.mark.parametrize(
    ("schema", "example"),
    [
        (SCHEMA, EXAMPLE),
        ({"type": "object", "properties": {"a": {"type": "number"}, "b": {}}}, {"a": 1, "b": None}),
        ({"type": ["null", "string"]}, "mock"),
        ({"anyOf": [{"const": 7}, {"type": "string"}]}, 7),
        ({"type": "string", "default": "kept"}, "kept"),
        ({"type": "array", "items": {"enum": ["x", "y"]}}, ["x"]),
        ({"type": "array"}, []),
        ({"properties": {"n": {"type": "integer"}}, "required": ["n", "absent"]}, {"n": 1}),
        ("not a schema", None),
    ],
)
def test_example_arguments_fit_the_schema(schema: Any, example: Any) -> None:
    assert example_of(schema) == example


def test_a_self_referencing_schema_ends() -> None:
    node: dict[str, Any] = {"type": "object", "properties": {}}
    node["properties"]["next"] = node
    value = example_of(node)
    depth = 0
    while isinstance(value, dict):
        value, depth = value["next"], depth + 1
    assert value is None
    assert depth == 9  # levels 0 to 8 are objects


CHOICES = [
    # (tool_choice, last turn hands back a tool result, tool called or None)
    (None, False, "get_weather"),
    ({"type": "auto"}, False, "get_weather"),
    ({"type": "auto"}, True, None),
    (None, True, None),
    ({"type": "none"}, False, None),
    ({"type": "any"}, True, "get_weather"),
    ({"type": "tool", "name": "get_time"}, False, "get_time"),
    ({"type": "tool", "name": "get_time"}, True, "get_time"),
    ({"type": "tool", "name": "not_offered"}, False, None),
]


@pytest.mark.parametrize(("choice", "after_result", "called"), CHOICES)
async def test_anthropic_tool_choice(
    mock: MockProvider, choice: Any, after_result: bool, called: str | None
) -> None:
    turns: Any = list(QUESTION)
    if after_result:
        turns += [
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}],
            },
        ]
    extra = {} if choice is None else {"tool_choice": choice}
    async with claude(mock) as client:
        message = await client.messages.create(
            model="m", max_tokens=64, messages=turns, tools=CLAUDE_TOOLS, **extra
        )
    names = [b.name for b in message.content if b.type == "tool_use"]
    assert names == ([called] if called else [])
    assert message.stop_reason == ("tool_use" if called else "end_turn")
    if not called:
        assert message.content[0].text == DEFAULT_REPLY  # type: ignore[union-attr]


OPENAI_CHOICES = [
    (None, False, "get_weather"),
    ("auto", True, None),
    ("none", False, None),
    ("required", True, "get_weather"),
    ("named", True, "get_time"),
]


@pytest.mark.parametrize(("choice", "after_result", "called"), OPENAI_CHOICES)
async def test_chat_tool_choice(
    mock: MockProvider, choice: str | None, after_result: bool, called: str | None
) -> None:
    turns: Any = list(QUESTION)
    if after_result:
        call = {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": "{}"},
        }
        turns += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]
    extra: dict[str, Any] = {}
    if choice == "named":
        extra["tool_choice"] = {"type": "function", "function": {"name": "get_time"}}
    elif choice is not None:
        extra["tool_choice"] = choice
    async with gpt(mock) as client:
        completion = await client.chat.completions.create(
            model="m", messages=turns, tools=CHAT_TOOLS, **extra
        )
    message = completion.choices[0].message
    assert [c.function.name for c in message.tool_calls or []] == ([called] if called else [])  # type: ignore[union-attr]
    assert completion.choices[0].finish_reason == ("tool_calls" if called else "stop")
    assert message.content == (None if called else DEFAULT_REPLY)


@pytest.mark.parametrize(("choice", "after_result", "called"), OPENAI_CHOICES)
async def test_responses_tool_choice(
    mock: MockProvider, choice: str | None, after_result: bool, called: str | None
) -> None:
    items: Any = list(QUESTION)
    if after_result:
        items += [
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": "{}",
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ]
    extra: dict[str, Any] = {}
    if choice == "named":
        extra["tool_choice"] = {"type": "function", "name": "get_time"}
    elif choice is not None:
        extra["tool_choice"] = choice
    async with gpt(mock) as client:
        response = await client.responses.create(
            model="m", input=items, tools=RESPONSES_TOOLS, **extra
        )
    calls = [item for item in response.output if item.type == "function_call"]
    assert [c.name for c in calls] == ([called] if called else [])
    assert response.output_text == ("" if called else DEFAULT_REPLY)


async def test_no_tools_offered_no_tool_called(mock: MockProvider) -> None:
    async with claude(mock) as client, gpt(mock) as o_client:
        message = await client.messages.create(model="m", max_tokens=9, messages=QUESTION)
        chat = await o_client.chat.completions.create(model="m", messages=QUESTION, tools=[])
    assert message.stop_reason == "end_turn"
    assert chat.choices[0].message.tool_calls is None
    assert mock.requests[0].tool_call_ids == ()


# --- tool calls, whole and streamed, on each wire -----------------------------------------


async def test_anthropic_tool_use(mock: MockProvider) -> None:
    async with claude(mock) as client:
        message = await client.messages.create(
            model="m", max_tokens=64, messages=QUESTION, tools=CLAUDE_TOOLS
        )
    (block,) = message.content
    assert block.type == "tool_use"
    assert block.name == "get_weather"
    assert block.input == EXAMPLE
    assert block.id.startswith("toolu_")
    assert mock.requests[0].tool_call_ids == (block.id,)
    assert (
        message.usage.output_tokens
        == len("get_weather" + json.dumps(EXAMPLE, separators=(",", ":"))) // 4
    )


async def test_anthropic_tool_use_streams(mock: MockProvider) -> None:
    mock.set_behaviour("*", Behaviour(chunks=4, tool_calls=2, tool_input={"q": "日本 🙂"}))
    async with (
        claude(mock) as client,
        client.messages.stream(
            model="m", max_tokens=64, messages=QUESTION, tools=CLAUDE_TOOLS
        ) as stream,
    ):
        events = [event async for event in stream]
        final = await stream.get_final_message()
    starts = [e for e in events if e.type == "content_block_start"]
    assert [(e.index, e.content_block.type) for e in starts] == [(0, "tool_use"), (1, "tool_use")]
    json_deltas = [e for e in events if e.type == "input_json"]
    assert [e.partial_json for e in json_deltas[:4]] == ['{"q', '":"', "日本 ", '🙂"}']
    assert len(json_deltas) == 8
    assert [(b.type, b.name, b.input) for b in final.content] == [  # type: ignore[union-attr]
        ("tool_use", "get_weather", {"q": "日本 🙂"}),
        ("tool_use", "get_time", {"q": "日本 🙂"}),
    ]
    assert final.stop_reason == "tool_use"
    assert [b.id for b in final.content] == list(mock.requests[0].tool_call_ids)  # type: ignore[union-attr]


async def test_chat_tool_calls(mock: MockProvider) -> None:
    mock.set_behaviour("*", Behaviour(tool_calls=2))
    async with gpt(mock) as client:
        completion = await client.chat.completions.create(
            model="m", messages=QUESTION, tools=CHAT_TOOLS
        )
    calls = completion.choices[0].message.tool_calls or []
    assert [(c.type, c.function.name) for c in calls] == [  # type: ignore[union-attr]
        ("function", "get_weather"),
        ("function", "get_time"),
    ]
    assert json.loads(calls[0].function.arguments) == EXAMPLE  # type: ignore[union-attr]
    assert json.loads(calls[1].function.arguments) == {}  # type: ignore[union-attr]
    assert all(c.id.startswith("call_") for c in calls)
    assert tuple(c.id for c in calls) == mock.requests[0].tool_call_ids


async def test_chat_tool_calls_stream(mock: MockProvider) -> None:
    mock.set_behaviour("*", Behaviour(chunks=3, tool_calls=2))
    tools = [
        {**t, "function": {**t["function"], "strict": True}} for t in CHAT_TOOLS
    ]  # the helper parses strict tools' arguments
    async with (
        gpt(mock) as client,
        client.chat.completions.stream(
            model="m", messages=QUESTION, tools=tools, stream_options={"include_usage": True}
        ) as stream,
    ):
        chunks = [e.chunk async for e in stream if e.type == "chunk"]
        final = await stream.get_final_completion()
    first = chunks[0].choices[0].delta
    assert first.role == "assistant"
    assert first.content is None
    assert [
        (t.index, t.id, t.function.name, t.function.arguments) for t in first.tool_calls or []
    ] == [  # type: ignore[union-attr]
        (0, mock.requests[0].tool_call_ids[0], "get_weather", "")
    ]
    # Every chunk but the last carries `usage: null`, as once the caller asked for usage.
    assert [c.usage for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-2].choices[0].finish_reason == "tool_calls"
    assert chunks[-1].choices == []
    calls = final.choices[0].message.tool_calls or []
    assert [c.function.parsed_arguments for c in calls] == [EXAMPLE, {}]
    assert tuple(c.id for c in calls) == mock.requests[0].tool_call_ids


async def test_responses_function_calls(mock: MockProvider) -> None:
    mock.set_behaviour("*", Behaviour(tool_calls=2))
    async with gpt(mock) as client:
        response = await client.responses.create(model="m", input=QUESTION, tools=RESPONSES_TOOLS)
    calls = response.output
    assert [(c.type, c.name, c.status) for c in calls] == [  # type: ignore[union-attr]
        ("function_call", "get_weather", "completed"),
        ("function_call", "get_time", "completed"),
    ]
    assert json.loads(calls[0].arguments) == EXAMPLE  # type: ignore[union-attr]
    assert all(c.id.startswith("fc_") and c.call_id.startswith("call_") for c in calls)  # type: ignore[union-attr]
    assert tuple(c.call_id for c in calls) == mock.requests[0].tool_call_ids  # type: ignore[union-attr]


async def test_responses_function_calls_stream(mock: MockProvider) -> None:
    mock.set_behaviour("*", Behaviour(chunks=3, tool_calls=2))
    async with (
        gpt(mock) as client,
        client.responses.stream(model="m", input=QUESTION, tools=RESPONSES_TOOLS) as stream,
    ):
        events = [event async for event in stream]
        final = await stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))

    def one_call(pieces: int) -> list[str]:
        return [
            "response.output_item.added",
            *["response.function_call_arguments.delta"] * pieces,
            "response.function_call_arguments.done",
            "response.output_item.done",
        ]

    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        *one_call(3),
        *one_call(2),  # "{}" comes in two pieces at most
        "response.completed",
    ]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(e.output_index, json.loads(e.arguments)) for e in done] == [(0, EXAMPLE), (1, {})]
    assert [item.arguments for item in final.output] == [e.arguments for e in done]  # type: ignore[union-attr]
    assert [item.id for item in final.output] == [e.item_id for e in done]


TEXT_FIRST = Behaviour(text_before_tools=True, reply="Let me look.", chunks=2)


async def test_anthropic_text_before_tool_use(mock: MockProvider) -> None:
    mock.set_behaviour("*", TEXT_FIRST)
    async with claude(mock) as client:
        message = await client.messages.create(
            model="m", max_tokens=64, messages=QUESTION, tools=CLAUDE_TOOLS
        )
        async with client.messages.stream(
            model="m", max_tokens=64, messages=QUESTION, tools=CLAUDE_TOOLS
        ) as stream:
            events = [event async for event in stream]
            final = await stream.get_final_message()
    for answer in (message, final):
        assert [b.type for b in answer.content] == ["text", "tool_use"]
        assert answer.content[0].text == "Let me look."  # type: ignore[union-attr]
        assert answer.content[1].input == EXAMPLE  # type: ignore[union-attr]
        assert answer.stop_reason == "tool_use"
    starts = [(e.index, e.content_block.type) for e in events if e.type == "content_block_start"]
    assert starts == [(0, "text"), (1, "tool_use")]
    assert [e.index for e in events if e.type == "content_block_stop"] == [0, 1]
    said = "Let me look." + "get_weather" + json.dumps(EXAMPLE, separators=(",", ":"))
    assert final.usage.output_tokens == len(said) // 4


async def test_chat_content_beside_tool_calls(mock: MockProvider) -> None:
    mock.set_behaviour("*", TEXT_FIRST)
    tools = [{**t, "function": {**t["function"], "strict": True}} for t in CHAT_TOOLS]
    async with gpt(mock) as client:
        completion = await client.chat.completions.create(
            model="m", messages=QUESTION, tools=CHAT_TOOLS
        )
        async with client.chat.completions.stream(
            model="m", messages=QUESTION, tools=tools
        ) as stream:
            chunks = [e.chunk async for e in stream if e.type == "chunk"]
            final = await stream.get_final_completion()
    for answer in (completion, final):
        message = answer.choices[0].message
        assert message.content == "Let me look."
        assert [c.function.name for c in message.tool_calls or []] == ["get_weather"]  # type: ignore[union-attr]
        assert answer.choices[0].finish_reason == "tool_calls"
    deltas = [c.choices[0].delta for c in chunks]
    assert (deltas[0].role, deltas[0].content, deltas[0].tool_calls) == ("assistant", "", None)
    assert [d.content for d in deltas[1:3]] == ["Let me", " look."]
    assert deltas[3].tool_calls is not None
    assert deltas[3].role is None


async def test_responses_message_before_function_call(mock: MockProvider) -> None:
    mock.set_behaviour("*", TEXT_FIRST)
    async with gpt(mock) as client:
        response = await client.responses.create(model="m", input=QUESTION, tools=RESPONSES_TOOLS)
        async with client.responses.stream(
            model="m", input=QUESTION, tools=RESPONSES_TOOLS
        ) as stream:
            events = [event async for event in stream]
            final = await stream.get_final_response()
    for answer in (response, final):
        assert [item.type for item in answer.output] == ["message", "function_call"]
        assert answer.output_text == "Let me look."
    added = [
        (e.output_index, e.item.type) for e in events if e.type == "response.output_item.added"
    ]
    assert added == [(0, "message"), (1, "function_call")]
    assert [e.sequence_number for e in events] == list(range(len(events)))


# --- thinking, when the request asks for it ------------------------------------------------

THOUGHT_TOKENS = len(THOUGHT) // 4


async def test_anthropic_thinking_block_comes_first(mock: MockProvider) -> None:
    thinking: Any = {"type": "enabled", "budget_tokens": 1024}
    async with claude(mock) as client:
        message = await client.messages.create(
            model="m", max_tokens=2048, messages=QUESTION, thinking=thinking
        )
        async with client.messages.stream(
            model="m", max_tokens=2048, messages=QUESTION, thinking=thinking, tools=CLAUDE_TOOLS
        ) as stream:
            events = [event async for event in stream]
            final = await stream.get_final_message()
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert [b.type for b in final.content] == ["thinking", "tool_use"]
    for answer in (message, final):
        block = answer.content[0]
        assert block.type == "thinking"
        assert block.thinking == THOUGHT
        assert block.signature
    assert "".join(e.thinking for e in events if e.type == "thinking") == THOUGHT
    assert [e.signature for e in events if e.type == "signature"] == [final.content[0].signature]  # type: ignore[union-attr]
    said = "get_weather" + json.dumps(EXAMPLE, separators=(",", ":"))
    assert final.usage.output_tokens == len(said) // 4 + THOUGHT_TOKENS
    assert message.usage.output_tokens == len(DEFAULT_REPLY) // 4 + THOUGHT_TOKENS


async def test_anthropic_without_thinking_has_no_thinking_block(mock: MockProvider) -> None:
    async with claude(mock) as client:
        message = await client.messages.create(
            model="m", max_tokens=9, messages=QUESTION, thinking={"type": "disabled"}
        )
    assert [b.type for b in message.content] == ["text"]
    assert message.usage.output_tokens == len(DEFAULT_REPLY) // 4


async def test_openai_reasoning_is_counted_and_a_responses_item(mock: MockProvider) -> None:
    async with gpt(mock) as client:
        completion = await client.chat.completions.create(
            model="m", messages=QUESTION, reasoning_effort="low"
        )
        plain = await client.chat.completions.create(model="m", messages=QUESTION)
        response = await client.responses.create(
            model="m", input="hi", reasoning={"effort": "medium"}
        )
        async with client.responses.stream(
            model="m", input="hi", reasoning={"effort": "high"}, tools=RESPONSES_TOOLS
        ) as stream:
            events = [event async for event in stream]
            final = await stream.get_final_response()
    usage = completion.usage
    assert usage is not None
    assert usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.reasoning_tokens == THOUGHT_TOKENS
    assert usage.completion_tokens == len(DEFAULT_REPLY) // 4 + THOUGHT_TOKENS
    assert completion.choices[0].message.content == DEFAULT_REPLY
    assert plain.usage is not None
    assert plain.usage.completion_tokens_details is not None
    assert plain.usage.completion_tokens_details.reasoning_tokens == 0
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output_text == DEFAULT_REPLY
    assert [item.type for item in final.output] == ["reasoning", "function_call"]
    for answer in (response, final):
        assert answer.usage is not None
        assert answer.usage.output_tokens_details.reasoning_tokens == THOUGHT_TOKENS
    added = [
        (e.output_index, e.item.type) for e in events if e.type == "response.output_item.added"
    ]
    assert added == [(0, "reasoning"), (1, "function_call")]
    assert final.output[0].id == events[2].item.id  # type: ignore[union-attr]
    assert [e.sequence_number for e in events] == list(range(len(events)))


# --- usage as each provider sends it ------------------------------------------------------

CACHE = Behaviour(cache_read_tokens=300, cache_write_tokens=40)


async def test_anthropic_usage_and_cache_fields(mock: MockProvider) -> None:
    mock.set_behaviour("*", CACHE)
    async with claude(mock) as client:
        message = await client.messages.create(model="m", max_tokens=9, messages=QUESTION)
        async with client.messages.stream(model="m", max_tokens=9, messages=QUESTION) as stream:
            events = [event async for event in stream]
            final = await stream.get_final_message()
    whole = message.usage
    assert (whole.cache_read_input_tokens, whole.cache_creation_input_tokens) == (300, 40)
    assert whole.cache_creation is not None
    assert whole.cache_creation.ephemeral_5m_input_tokens == 40
    assert whole.input_tokens == len(mock.requests[0].body) // 4
    start = events[0]
    assert start.type == "message_start"
    assert start.message.usage.input_tokens == len(mock.requests[1].body) // 4
    assert start.message.usage.cache_read_input_tokens == 300
    assert start.message.usage.output_tokens == 1
    (delta,) = [e for e in events if e.type == "message_delta"]
    # The current API repeats input and cache counts in message_delta, beside the output's.
    assert delta.usage.input_tokens == start.message.usage.input_tokens
    assert (delta.usage.cache_read_input_tokens, delta.usage.cache_creation_input_tokens) == (
        300,
        40,
    )
    assert delta.usage.output_tokens == len(DEFAULT_REPLY) // 4
    assert final.usage.output_tokens == delta.usage.output_tokens
    assert final.usage.cache_read_input_tokens == 300


async def test_chat_usage_and_cached_tokens(mock: MockProvider) -> None:
    mock.set_behaviour("*", CACHE)
    async with gpt(mock) as client:
        completion = await client.chat.completions.create(model="m", messages=QUESTION)
        stream = await client.chat.completions.create(
            model="m", messages=QUESTION, stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
        plain = await client.chat.completions.create(model="m", messages=QUESTION, stream=True)
        unasked = [chunk async for chunk in plain]
    for usage, body in (
        (completion.usage, mock.requests[0].body),
        (chunks[-1].usage, mock.requests[1].body),
    ):
        assert usage is not None
        assert usage.prompt_tokens == len(body) // 4 + 340  # cached tokens count in the prompt's
        assert usage.prompt_tokens_details is not None
        assert usage.prompt_tokens_details.cached_tokens == 300
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert [c.usage for c in unasked] == [None] * len(unasked)
    # Without include_usage no chunk carries a usage key at all, not even null.
    assert all(
        "usage" not in (c.model_extra or {}) and "usage" not in c.model_fields_set for c in unasked
    )


async def test_responses_usage_and_cached_tokens(mock: MockProvider) -> None:
    mock.set_behaviour("*", CACHE)
    async with gpt(mock) as client:
        response = await client.responses.create(model="m", input="hi")
        async with client.responses.stream(model="m", input="hi") as stream:
            events = [event async for event in stream]
    created = events[0]
    assert created.type == "response.created"
    assert created.response.usage is None
    completed = events[-1]
    assert completed.type == "response.completed"
    for usage, body in (
        (response.usage, mock.requests[0].body),
        (completed.response.usage, mock.requests[1].body),
    ):
        assert usage is not None
        assert usage.input_tokens == len(body) // 4 + 340
        assert usage.input_tokens_details.cached_tokens == 300
        assert usage.total_tokens == usage.input_tokens + usage.output_tokens


def test_cache_figures_are_validated() -> None:
    with pytest.raises(ValueError, match="cache_read_tokens"):
        Behaviour(cache_read_tokens=-1)
    with pytest.raises(ValueError, match="tool_calls"):
        Behaviour(tool_calls=0)


async def test_answers_carry_a_request_id(mock: MockProvider) -> None:
    mock.set_behaviour("denied", Behaviour(status=429))
    async with claude(mock) as client, gpt(mock) as o_client:
        message = await client.messages.create(model="m", max_tokens=9, messages=QUESTION)
        completion = await o_client.chat.completions.create(model="m", messages=QUESTION)
        stream = await o_client.responses.create(model="m", input="hi", stream=True)
        async for _ in stream:
            pass
        with pytest.raises(openai.RateLimitError) as info:
            await o_client.with_options(api_key="denied").responses.create(model="m", input="hi")
    assert message._request_id is not None
    assert message._request_id.startswith("req_")
    assert completion._request_id is not None
    assert completion._request_id.startswith("req_")
    assert stream.response.headers["x-request-id"].startswith("req_")
    assert info.value.request_id is not None


# --- answers that break off mid-stream with the wire's error event ------------------------


async def test_error_mid_stream_anthropic(tcp: tuple[MockProvider, str]) -> None:
    mock, url = tcp
    mock.set_behaviour("*", Behaviour(fail="error_mid_stream", stall_after_chunks=2))
    events: list[Any] = []
    async with anthropic.AsyncAnthropic(api_key="k", base_url=url, max_retries=0) as client:
        stream = await client.messages.create(
            model="m", max_tokens=9, messages=QUESTION, stream=True
        )
        with pytest.raises(anthropic.APIStatusError) as info:
            await collect(stream, events)
    assert [e.type for e in events].count("content_block_delta") == 2
    assert info.value.body == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "Mock provider overloaded mid-stream."},
    }


async def test_error_mid_stream_chat(tcp: tuple[MockProvider, str]) -> None:
    mock, url = tcp
    mock.set_behaviour("*", Behaviour(fail="error_mid_stream", stall_after_chunks=1))
    chunks: list[Any] = []
    async with gpt(mock, url) as client:
        stream = await client.chat.completions.create(model="m", messages=QUESTION, stream=True)
        with pytest.raises(openai.APIError) as info:
            await collect(stream, chunks)
    assert [c.choices[0].delta.content for c in chunks] == ["", "Hello fro"]
    assert info.value.message == "Mock provider overloaded mid-stream."


async def test_error_mid_stream_responses(tcp: tuple[MockProvider, str]) -> None:
    mock, url = tcp
    mock.set_behaviour("*", Behaviour(fail="error_mid_stream", stall_after_chunks=3))
    events: list[Any] = []
    async with gpt(mock, url) as client:
        stream = await client.responses.create(model="m", input="hi", stream=True)
        await collect(stream, events)
    # The SDK hands the error event over as a typed event: the stream ends there.
    assert events[-1].type == "error"
    assert events[-1].code == "server_error"
    assert events[-1].message == "Mock provider overloaded mid-stream."
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events].count("response.output_text.delta") == 3
    assert "response.completed" not in [e.type for e in events]


async def test_error_mid_stream_without_streaming_breaks_off(tcp: tuple[MockProvider, str]) -> None:
    mock, url = tcp
    mock.set_behaviour("*", Behaviour(fail="error_mid_stream"))
    async with gpt(mock, url) as client:
        with pytest.raises(openai.APIConnectionError):
            await client.chat.completions.create(model="m", messages=QUESTION)


# --- compressed answers -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("accept", "gzipped"),
    [
        ("gzip, deflate", True),
        ("br;q=1.0, GZIP;q=0.5", True),
        ("*", True),
        ("gzip;q=0", False),
        ("identity", False),
        (None, False),
    ],
)
async def test_gzip_answers_when_accepted(
    mock: MockProvider, accept: str | None, gzipped: bool
) -> None:
    mock.set_behaviour("*", Behaviour(content_encoding="gzip"))
    headers = {"accept-encoding": accept} if accept is not None else {}
    body = {"model": "m", "max_tokens": 9, "messages": QUESTION}
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=mock), base_url="http://mock.test"
    ) as http:
        request = http.build_request("POST", "/v1/messages", json=body, headers=headers)
        if accept is None:
            del request.headers["accept-encoding"]
        answer = await http.send(request, stream=True)
        raw = b"".join([piece async for piece in answer.aiter_raw()])
    assert answer.headers.get("content-encoding") == ("gzip" if gzipped else None)
    assert answer.headers["content-length"] == str(len(raw))
    text = gzip.decompress(raw) if gzipped else raw
    assert json.loads(text)["content"][0]["text"] == DEFAULT_REPLY


async def test_gzip_answers_reach_the_sdks_and_streams_stay_plain(mock: MockProvider) -> None:
    mock.set_behaviour("*", Behaviour(content_encoding="gzip"))
    async with claude(mock) as client, gpt(mock) as o_client:
        raw = await client.messages.with_raw_response.create(
            model="m", max_tokens=9, messages=QUESTION
        )
        message = await raw.parse()
        response = await o_client.responses.create(model="m", input="hi")
        stream = await o_client.chat.completions.with_raw_response.create(
            model="m", messages=QUESTION, stream=True
        )
        chunks = [chunk async for chunk in stream.parse()]
    assert raw.headers["content-encoding"] == "gzip"
    assert message.content[0].text == DEFAULT_REPLY  # type: ignore[union-attr]
    assert response.output_text == DEFAULT_REPLY
    assert "content-encoding" not in stream.headers
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == DEFAULT_REPLY


async def test_control_api_lists_the_tool_call_ids(tcp: tuple[MockProvider, str]) -> None:
    mock, url = tcp
    async with gpt(mock, url) as client, httpx.AsyncClient(base_url=url) as http:
        await http.put("/_mock/behaviours/*", json={"tool_calls": 2, "tool_input": {"q": 1}})
        completion = await client.chat.completions.create(
            model="m", messages=QUESTION, tools=CHAT_TOOLS
        )
        records = (await http.get("/_mock/requests")).json()
    ids = [call.id for call in completion.choices[0].message.tool_calls or []]
    assert len(ids) == 2
    assert records[-1]["tool_call_ids"] == ids


# --- answers cut at the request's output cap ----------------------------------------------

LONG = "Twelve bytes" * 10  # 120 bytes: 30 tokens


async def test_stop_at_max_tokens_anthropic(mock: MockProvider) -> None:
    mock.set_behaviour("*", Behaviour(reply=LONG, stop_at_max_tokens=True))
    async with claude(mock) as client:
        cut = await client.messages.create(model="m", max_tokens=5, messages=QUESTION)
        whole = await client.messages.create(model="m", max_tokens=30, messages=QUESTION)
        async with client.messages.stream(model="m", max_tokens=5, messages=QUESTION) as stream:
            streamed = await stream.get_final_message()
    for message in (cut, streamed):
        assert message.stop_reason == "max_tokens"
        assert message.content[0].text == LONG[:20]  # type: ignore[union-attr]
        assert message.usage.output_tokens == 5
    assert whole.stop_reason == "end_turn"
    assert whole.content[0].text == LONG  # type: ignore[union-attr]


async def test_stop_at_max_tokens_spends_the_thought_first(mock: MockProvider) -> None:
    mock.set_behaviour("*", Behaviour(reply=LONG, stop_at_max_tokens=True))
    thinking: Any = {"type": "enabled", "budget_tokens": 1024}
    cap = len(THOUGHT) // 4 + 2
    async with claude(mock) as client:
        message = await client.messages.create(
            model="m", max_tokens=cap, messages=QUESTION, thinking=thinking
        )
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[1].text == LONG[:8]  # type: ignore[union-attr]
    assert message.usage.output_tokens == cap


async def test_stop_at_max_tokens_openai(mock: MockProvider) -> None:
    mock.set_behaviour("*", Behaviour(reply=LONG, stop_at_max_tokens=True))
    async with gpt(mock) as client:
        chat = await client.chat.completions.create(
            model="m", messages=QUESTION, max_completion_tokens=3
        )
        legacy = await client.chat.completions.create(model="m", messages=QUESTION, max_tokens=4)
        response = await client.responses.create(model="m", input="hi", max_output_tokens=16)
        async with client.responses.stream(model="m", input="hi", max_output_tokens=16) as stream:
            events = [event async for event in stream]
    assert chat.choices[0].finish_reason == "length"
    assert chat.choices[0].message.content == LONG[:12]
    assert legacy.choices[0].message.content == LONG[:16]
    assert legacy.usage is not None
    assert legacy.usage.completion_tokens == 4
    assert events[-1].type == "response.incomplete"
    for answer in (response, events[-1].response):
        assert answer.status == "incomplete"
        assert answer.incomplete_details is not None
        assert answer.incomplete_details.reason == "max_output_tokens"
        assert answer.output_text == LONG[:64]
        assert answer.usage is not None
        assert answer.usage.output_tokens == 16


async def test_tool_calls_are_not_cut(mock: MockProvider) -> None:
    mock.set_behaviour("*", Behaviour(stop_at_max_tokens=True))
    async with claude(mock) as client:
        message = await client.messages.create(
            model="m", max_tokens=1, messages=QUESTION, tools=CLAUDE_TOOLS
        )
    assert message.stop_reason == "tool_use"
    assert message.content[0].input == EXAMPLE  # type: ignore[union-attr]


# --- every answer and event validates against the SDKs' types -----------------------------

# The SDKs build their objects without validating them (a missing required field only shows
# when read), so each body and event is validated here, as a stricter client would.
SHAPES: dict[str, tuple[Any, Any]] = {
    "/v1/messages": (anthropic.types.Message, anthropic.types.RawMessageStreamEvent),
    "/v1/chat/completions": (
        openai.types.chat.ChatCompletion,
        openai.types.chat.ChatCompletionChunk,
    ),
    "/v1/responses": (openai.types.responses.Response, openai.types.responses.ResponseStreamEvent),
}
BODIES: dict[str, dict[str, Any]] = {
    "/v1/messages": {"max_tokens": 20, "messages": QUESTION, "tools": CLAUDE_TOOLS},
    "/v1/chat/completions": {
        "max_completion_tokens": 20,
        "messages": QUESTION,
        "tools": CHAT_TOOLS,
        "stream_options": {"include_usage": True},
    },
    "/v1/responses": {"max_output_tokens": 20, "input": QUESTION, "tools": RESPONSES_TOOLS},
}
THINK: dict[str, dict[str, Any]] = {
    "/v1/messages": {"thinking": {"type": "enabled", "budget_tokens": 1024}},
    "/v1/chat/completions": {"reasoning_effort": "low"},
    "/v1/responses": {"reasoning": {"effort": "low"}},
}
VARIANTS = {
    "tools": (Behaviour(tool_calls=2, cache_read_tokens=7, cache_write_tokens=3), False, True),
    "text_first": (Behaviour(text_before_tools=True), True, True),
    "text": (Behaviour(), True, False),
    "cut_short": (Behaviour(reply=LONG, stop_at_max_tokens=True), True, False),
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("path", SHAPES)
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_answers_validate_against_the_sdk_types(
    mock: MockProvider, path: str, variant: str, stream: bool
) -> None:
    behaviour, thinking, tools = VARIANTS[variant]
    mock.set_behaviour("*", behaviour)
    whole_type, event_type = SHAPES[path]
    body = {"model": "m", "stream": stream, **BODIES[path], **(THINK[path] if thinking else {})}
    if not tools:
        body.pop("tools")
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=mock), base_url="http://mock.test"
    ) as http:
        answer = await http.post(path, json=body)
    assert answer.status_code == 200
    if not stream:
        whole_type.model_validate(answer.json())
        return
    adapter = pydantic.TypeAdapter(event_type)
    events = [
        json.loads(line.removeprefix("data: "))
        for line in answer.text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
    validated = [adapter.validate_python(e) for e in events if e.get("type") != "ping"]
    assert len(validated) >= 4


# --- a context-length refusal, in each wire's shape ------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_context_length_refusal_is_each_sdk_s_bad_request(
    mock: MockProvider, stream: bool
) -> None:
    mock.set_behaviour("k", Behaviour(refuse="context_length"))
    with pytest.raises(anthropic.BadRequestError) as claude_error:
        await claude(mock).messages.create(
            model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}], stream=stream
        )
    assert claude_error.value.status_code == 400
    body: Any = claude_error.value.body
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith("prompt is too long: ")
    client = gpt(mock)
    with pytest.raises(openai.BadRequestError) as chat_error:
        await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=stream
        )
    assert (chat_error.value.code, chat_error.value.param) == (
        "context_length_exceeded",
        "messages",
    )
    assert "This model's maximum context length is" in chat_error.value.message
    with pytest.raises(openai.BadRequestError) as responses_error:
        await client.responses.create(model="m", input="hi", stream=stream)
    assert (responses_error.value.code, responses_error.value.param) == (
        "context_length_exceeded",
        "input",
    )
    assert responses_error.value.type == "invalid_request_error"
    assert len(mock.requests) == 3


@pytest.mark.parametrize("stream", [False, True])
async def test_billing_refusal_is_each_api_s_own(mock: MockProvider, stream: bool) -> None:
    """An account without credit or quota: Anthropic's 400 "credit balance is too low",
    OpenAI's 429 `insufficient_quota` (Chat and Responses), as the SDKs raise them."""
    mock.set_behaviour("k", Behaviour(refuse="billing"))
    with pytest.raises(anthropic.BadRequestError) as claude_error:
        await claude(mock).messages.create(
            model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}], stream=stream
        )
    body: Any = claude_error.value.body
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith("Your credit balance is too low")
    client = gpt(mock)
    with pytest.raises(openai.RateLimitError) as chat_error:
        await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=stream
        )
    assert (chat_error.value.code, chat_error.value.type) == (
        "insufficient_quota",
        "insufficient_quota",
    )
    assert chat_error.value.response.headers["retry-after"] == "1"
    with pytest.raises(openai.RateLimitError) as responses_error:
        await client.responses.create(model="m", input="hi", stream=stream)
    assert responses_error.value.code == "insufficient_quota"
    assert len(mock.requests) == 3


async def test_context_length_refusal_is_opt_in(mock: MockProvider) -> None:
    assert Behaviour().refuse == "none"
    reply = await gpt(mock).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}]
    )
    assert reply.choices[0].message.content == DEFAULT_REPLY
