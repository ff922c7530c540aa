"""One call of each official SDK through a gateway, stream or not: the answer's text and
headers (shared by the tests that drive Envoy with the SDKs)."""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import pytest


async def anthropic_call(gateway: str, model: str, stream: bool) -> tuple[str, Any]:
    client = anthropic.AsyncAnthropic(base_url=gateway, api_key="caller", max_retries=0)
    request: Any = {
        "model": model,
        "max_tokens": 50,
        "messages": [{"role": "user", "content": "hi"}],
    }
    try:
        if stream:
            async with client.messages.stream(**request) as events:
                text = "".join([chunk async for chunk in events.text_stream])
                return text, events.response.headers
        raw = await client.messages.with_raw_response.create(**request)
        message = await raw.parse()
        assert message.content[0].type == "text"
        return message.content[0].text, raw.headers
    finally:
        await client.close()


async def anthropic_message(
    client: anthropic.AsyncAnthropic, request: Any, stream: bool
) -> tuple[Any, Any]:
    """`request` through `client`, streamed or whole: the final message and the headers."""
    if stream:
        async with client.messages.stream(**request) as events:
            return await events.get_final_message(), events.response.headers
    raw = await client.messages.with_raw_response.create(**request)
    return await raw.parse(), raw.headers


async def openai_call(gateway: str, model: str, stream: bool, responses: bool) -> tuple[str, Any]:
    client = openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key="caller", max_retries=0)
    try:
        if responses:
            raw: Any = await client.responses.with_raw_response.create(
                model=model, input="hi", stream=stream
            )
            if stream:
                events = [e async for e in raw.parse()]
                text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
            else:
                text = raw.parse().output_text
            return text, raw.headers
        raw = await client.chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "user", "content": "hi"}], stream=stream
        )
        if stream:
            chunks = [c async for c in raw.parse()]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            text = raw.parse().choices[0].message.content
        return text, raw.headers
    finally:
        await client.close()


STREAMS = pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
OPENAI_WIRES = pytest.mark.parametrize("responses", [False, True], ids=["chat", "responses"])


async def responses_model_names(client: openai.AsyncOpenAI, model: str, stream: bool) -> list[str]:
    """Every `model` a Responses answer shows the SDK: the whole answer's, or each
    `response.*` event's and the final response's (at least three)."""
    if not stream:
        return [(await client.responses.create(model=model, input="hi")).model]
    names = []
    async with client.responses.stream(model=model, input="hi") as events:
        async for event in events:
            if event.type in ("response.created", "response.in_progress", "response.completed"):
                names.append(event.response.model)
        names.append((await events.get_final_response()).model)
    assert len(names) >= 3  # response.created, response.completed, the final response
    return names
