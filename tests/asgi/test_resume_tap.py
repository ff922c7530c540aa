"""The resumed stream's tap inside the stack, in process: frames cut anywhere between the app's
messages reach the client whole and once, and the continuation is spliced into them."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from conftest import Metrics
from switchyard_mw.asgi.stack import switchyard_stack
from switchyard_mw.context import current_context

CONFIG = """
[server]
resume_streams = true

[llm_clients.a]
base_url = "http://127.0.0.1:9"
api_key_env = "K"
models = ["m"]

[llm_clients.b]
base_url = "http://127.0.0.1:9"
api_key_env = "K"
models = ["m"]
priority = 1
"""
BODY = json.dumps(
    {"model": "m", "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
).encode()
SSE = [(b"content-type", b"text/event-stream")]


def frame(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()


def delta(text: str) -> bytes:
    return frame(
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}
    )


OPENING = frame(
    {"type": "message_start", "message": {"id": "m1", "usage": {"input_tokens": 3}}}
) + frame(
    {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
)
CLOSING = (
    frame({"type": "content_block_stop", "index": 0})
    + frame({"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {}})
    + frame({"type": "message_stop"})
)
ERROR = frame({"type": "error", "error": {"type": "upstream_error", "message": "cut"}})


def pieces(data: bytes, size: int) -> list[bytes]:
    """`data` cut every `size` bytes, wherever that falls."""
    return [data[i : i + size] for i in range(0, len(data), size)]


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    ctx = current_context()
    assert ctx is not None
    assert ctx.account is not None
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": SSE})
    if ctx.account.name == "a":
        stream = OPENING + delta("Hello, ") + delta("wor")
        for piece in pieces(stream, 37):  # the first content's message ends inside a frame
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        ctx.report_upstream(502)
        await send({"type": "http.response.body", "body": ERROR, "more_body": True})
    else:
        for piece in pieces(OPENING + delta("ld!") + CLOSING, 23):
            await send({"type": "http.response.body", "body": piece, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def drive(stack: Any, headers: list[tuple[bytes, bytes]]) -> list[dict[str, Any]]:
    """One streamed Messages request through `stack` (its body once, then a client that stays);
    what the stack sent."""
    sent: list[dict[str, Any]] = []
    given = False

    async def receive() -> dict[str, Any]:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": BODY, "more_body": False}
        await asyncio.Event().wait()
        raise AssertionError

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/messages",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), *headers],
        "state": {},
    }
    await asyncio.wait_for(stack(scope, receive, send), 10)
    return sent


async def test_a_cut_stream_reaches_the_client_whole_and_once_with_its_continuation(
    tmp_path: Path,
) -> None:
    path = tmp_path / "s.toml"
    path.write_text(CONFIG)
    stack = switchyard_stack(app, config=path, environ={"K": "k"})
    sent = await drive(stack, [])
    assert [m["type"] for m in sent].count("http.response.start") == 1
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    body = b"".join(m.get("body", b"") for m in sent[1:])
    frames = [f for f in body.split(b"\n\n") if f]
    events = [json.loads(f.split(b"\ndata: ", 1)[1]) for f in frames]
    # Every frame whole: its `event:` line names its data's type (none cut, none doubled).
    assert [f.split(b"\n")[0] for f in frames] == [f"event: {e['type']}".encode() for e in events]
    kinds = [e["type"] for e in events]
    assert kinds.count("message_start") == 1
    assert kinds.count("content_block_start") == 1
    assert kinds[-1] == "message_stop"
    assert "error" not in kinds
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert text == "Hello, world!"


async def hangs_on_a(calls: list[str]) -> Any:
    """An app whose stream on account a goes silent after its first content; b answers whole."""

    async def run(scope: dict[str, Any], receive: Any, send: Any) -> None:
        ctx = current_context()
        assert ctx is not None
        assert ctx.account is not None
        calls.append(ctx.account.name)
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": SSE})
        if ctx.account.name == "a":
            body = OPENING + delta("Hello, ")
            await send({"type": "http.response.body", "body": body, "more_body": True})
            await asyncio.sleep(30)
        else:
            body = OPENING + delta("world!") + CLOSING
            await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return run


async def serve(tmp_path: Path, config: str, headers: list[tuple[bytes, bytes]]) -> list[Any]:
    path = tmp_path / "s.toml"
    path.write_text(config)
    calls: list[str] = []
    stack = switchyard_stack(await hangs_on_a(calls), config=path, environ={"K": "k"})
    sent = await drive(stack, headers)
    body = b"".join(m.get("body", b"") for m in sent[1:])
    events = [json.loads(f.split(b"\ndata: ", 1)[1]) for f in body.split(b"\n\n") if f]
    return [calls, events]


async def test_a_stream_that_went_idle_is_resumed_on_another_account(
    tmp_path: Path, otel_metrics: Metrics
) -> None:
    before = otel_metrics.value("switchyard.resumes", reason="idle", result="resumed")
    config = CONFIG.replace('models = ["m"]\n', 'models = ["m"]\nstream_idle_secs = 0.3\n', 1)
    calls, events = await serve(tmp_path, config, [])
    assert calls == ["a", "b"]
    assert otel_metrics.value("switchyard.resumes", reason="idle", result="resumed") == before + 1
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert text == "Hello, world!"
    assert events[-1]["type"] == "message_stop"


async def test_a_stream_whose_budget_ran_out_is_not_resumed(
    tmp_path: Path, otel_metrics: Metrics
) -> None:
    # The caller's budget is over: no time for a continuation, its end is the answer, and
    # no resume is tried (none counted, not even as unavailable).
    before = otel_metrics.value("switchyard.resumes")
    calls, events = await serve(tmp_path, CONFIG, [(b"x-switchyard-timeout-ms", b"400")])
    assert calls == ["a"]
    assert otel_metrics.value("switchyard.resumes") == before
    assert [e["type"] for e in events][-1] == "error"
    assert "budget" in json.dumps(events[-1])
