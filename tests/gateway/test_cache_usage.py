"""Prompt cache reads and writes through the ASGI stack and the gateway's forwarder, on every
wire, streams included: recorded in `gen_ai.client.token.usage` as their own token types
(`cache_read`, `cache_creation`) and on the request's span as the GenAI conventions' usage
attributes, while `input` keeps counting every input token."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from starlette.applications import Starlette
from starlette.routing import Route

from switchyard_mw.asgi.stack import switchyard_stack
from switchyard_mw.config import parse_config
from switchyard_mw.gateway import WIRE_ROUTES, Forwarder
from switchyard_mw.telemetry import names as tm
from switchyard_mw.telemetry import request_metrics as rm
from switchyard_mw.testing import Behaviour, MockProvider
from usage_streams import all_input

MODEL = "cache-usage-model"  # the requests' own label set: other tests do not add to it
CONFIG = f"""
[llm_clients.cache-acct]
base_url = "http://mock.test"
api_key_env = "KEY_C"
auth = "x-api-key"
models = ["{MODEL}"]
"""
READ, WRITE = 2048, 300
TURN = [{"role": "user", "content": "what did we say?"}]
REQUESTS: dict[str, dict[str, Any]] = {
    "/v1/messages": {"model": MODEL, "max_tokens": 8, "messages": TURN},
    "/v1/chat/completions": {"model": MODEL, "messages": TURN},
    "/v1/responses": {"model": MODEL, "input": TURN},
}
# Anthropic says what it read and wrote; OpenAI's wires only what they read.
SAID = {
    "/v1/messages": (READ, WRITE),
    "/v1/chat/completions": (READ, None),
    "/v1/responses": (READ, None),
}


@pytest.fixture
async def gateway() -> AsyncIterator[httpx.AsyncClient]:
    mock = MockProvider()
    mock.set_behaviour("*", Behaviour(cache_read_tokens=READ, cache_write_tokens=WRITE))
    upstream = httpx.AsyncClient(transport=httpx.ASGITransport(app=mock))
    app = Starlette(routes=[Route(p, Forwarder(upstream), methods=["POST"]) for p in WIRE_ROUTES])
    stack = switchyard_stack(app, config=parse_config(CONFIG), environ={"KEY_C": "kc"})
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=stack), base_url="http://gw.test"
    ) as client:
        yield client
    await upstream.aclose()


def tokens() -> dict[str, tuple[int, float]]:
    """(count, sum) of the requests' `gen_ai.client.token.usage` points by token type."""
    rm.requests.fold()
    metric = rm.token_usage.metric(time.time_ns())
    out: dict[str, tuple[int, float]] = {}
    for point in metric.data.data_points if metric is not None else ():
        attributes = dict(point.attributes or {})
        if attributes.get(tm.REQUEST_MODEL) == MODEL:
            kind = str(attributes[tm.TOKEN_TYPE])
            count, total = out.get(kind, (0, 0.0))
            out[kind] = (count + point.count, total + point.sum)  # type: ignore[attr-defined]
    return out


def added(before: dict[str, tuple[int, float]], kind: str) -> float | None:
    count, total = tokens().get(kind, (0, 0.0))
    was_count, was_total = before.get(kind, (0, 0.0))
    return None if count == was_count else total - was_total


def input_said(path: str, usage: dict[str, Any]) -> int:
    """Every input token of a usage object, as the GenAI conventions count them."""
    if path == "/v1/messages":
        return all_input(usage)
    return int(usage["prompt_tokens"] if path == "/v1/chat/completions" else usage["input_tokens"])


def last_usage(path: str, body: bytes) -> dict[str, Any]:
    """The usage a stream ends with (Anthropic: its `message_delta` repeats the input's)."""
    found: dict[str, Any] = {}
    for line in body.split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        event = msgspec.json.decode(line[6:])
        usage = event.get("usage") or (event.get("response") or {}).get("usage")
        usage = usage or (event.get("message") or {}).get("usage")
        if usage:
            found = {**found, **usage}
    assert found, body[:200]
    return found


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("path", list(REQUESTS))
async def test_cache_reads_and_writes_are_their_own_token_types_and_span_attributes(
    gateway: httpx.AsyncClient, otel_spans: InMemorySpanExporter, path: str, stream: bool
) -> None:
    asked = {**REQUESTS[path], "stream": stream}
    if stream and path == "/v1/chat/completions":
        asked["stream_options"] = {"include_usage": True}
    before = tokens()
    reply = await gateway.post(path, json=asked)
    assert reply.status_code == 200
    usage = last_usage(path, reply.content) if stream else reply.json()["usage"]

    read, write = SAID[path]
    assert (added(before, "cache_read"), added(before, "cache_creation")) == (read, write)
    assert added(before, "input") == input_said(path, usage)  # the cached parts included

    spans = otel_spans.get_finished_spans()
    (request,) = [s for s in spans if s.name == tm.SPAN_REQUEST]
    (client,) = [s for s in spans if s.name == tm.SPAN_CLIENT.format(model=MODEL)]
    for span in (request, client):  # the request's, and its one attempt's GenAI client span
        attributes = dict(span.attributes or {})
        assert attributes[tm.USAGE_INPUT_TOKENS] == input_said(path, usage)
        assert attributes[tm.USAGE_CACHE_READ_TOKENS] == read
        assert attributes.get(tm.USAGE_CACHE_CREATION_TOKENS) == write


async def test_a_conversations_later_turns_read_what_its_first_wrote(
    otel_spans: InMemorySpanExporter,
) -> None:
    """With the mock's own prompt cache (no set counts): the first turn writes, the second
    reads the first's prompt back, on the one account."""
    mock = MockProvider()
    upstream = httpx.AsyncClient(transport=httpx.ASGITransport(app=mock))
    app = Starlette(routes=[Route(p, Forwarder(upstream), methods=["POST"]) for p in WIRE_ROUTES])
    stack = switchyard_stack(app, config=parse_config(CONFIG), environ={"KEY_C": "kc"})
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=stack), base_url="http://gw")
    try:
        messages: list[dict[str, str]] = [{"role": "user", "content": "a long start. " * 40}]
        before = tokens()
        first = (
            await client.post(
                "/v1/messages", json={**REQUESTS["/v1/messages"], "messages": messages}
            )
        ).json()
        assert added(before, "cache_read") == 0
        assert added(before, "cache_creation") == first["usage"]["cache_creation_input_tokens"] > 0
        messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
        before = tokens()
        second = (
            await client.post(
                "/v1/messages", json={**REQUESTS["/v1/messages"], "messages": messages}
            )
        ).json()
        read = second["usage"]["cache_read_input_tokens"]
        assert read > 0
        assert added(before, "cache_read") == read
        assert added(before, "input") == all_input(second["usage"])
    finally:
        await client.aclose()
        await upstream.aclose()
