"""Call budgets held in tests (issue 45): the counts a path makes, recorded per Python version
in a JSON file beside the test that counts them, the one rule that compares them, and the
requests both fronts' counts are made of (two accounts, three wires, the answers providers
send)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Awaitable
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

import pytest

from switchyard_mw.engine import machine

SLACK = 0.02
"""A count this much under its budget asks for the budget to be lowered."""
COMPILED = not str(machine.__file__).endswith(".py")
"""Whether the engine runs compiled (the optional mypyc build): its calls are not Python's."""
VERSION = f"{sys.version_info.major}.{sys.version_info.minor}" + ("-compiled" if COMPILED else "")
"""The key of the budgets that hold for this interpreter and build."""


def recorded(path: Path) -> dict[str, int]:
    """The budgets `path` records for this Python version."""
    budgets: dict[str, dict[str, int]] = json.loads(path.read_text())
    return budgets.get(VERSION, {})


T = TypeVar("T")


async def calls_of(work: Awaitable[T]) -> tuple[int, T]:
    """The Python-level calls ("call" and "c_call" profile events) made while awaiting
    `work`, and its result."""
    events = 0

    def profile(frame: FrameType, event: str, arg: object) -> None:
        nonlocal events
        if event in ("call", "c_call"):
            events += 1

    sys.setprofile(profile)
    try:
        result = await work
    finally:
        sys.setprofile(None)
    return events, result


def counted_apart(script: Path) -> dict[str, int]:
    """Every case's count from a fresh interpreter running `script` (which prints them): no
    test session's OpenTelemetry SDK (the conftest installs one), so what is counted is the
    path in an app that configured none, and a dependency's own cost does not move the
    figures."""
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        check=True,
        text=True,
        cwd=script.parent,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    counts: dict[str, int] = json.loads(done.stdout)[VERSION]
    return counts


def check(name: str, count: int, path: Path) -> None:
    """Fail when `count` calls for case `name` break its budget in `path`; skip when none is
    recorded for this Python version."""
    try:
        broken = held(name, count, path)
    except LookupError as missing:
        pytest.skip(str(missing))
    assert broken is None, broken


def held(name: str, count: int, path: Path) -> str | None:
    """Why `count` calls for case `name` break its budget in `path` (None: they keep it; a
    version or case without a budget raises LookupError, naming the count to record)."""
    budgets = recorded(path)
    if name not in budgets:
        raise LookupError(f"no budget recorded for Python {VERSION}: {name} makes {count} calls")
    budget = budgets[name]
    if count > budget:
        return (
            f"{name}: {count} calls, over its budget of {budget} by {count - budget}: "
            f"make the path cheaper, or raise the budget in {path.name} with a commit "
            "message saying what the calls buy"
        )
    if count < budget * (1 - SLACK):
        return (
            f"{name}: {count} calls, {budget - count} under its budget of {budget}: "
            f"lower the budget in {path.name} to hold the gain"
        )
    return None


CONFIG = """
[llm_clients.primary]
base_url = "http://primary.test"
api_key_env = "KEY_PRIMARY"
auth = "x-api-key"
models = ["claude-opus-5", "gpt-5"]

[llm_clients.secondary]
base_url = "http://secondary.test"
api_key_env = "KEY_SECONDARY"
models = ["claude-opus-5", "gpt-5"]
priority = 1
"""
ENV = {"KEY_PRIMARY": "k1", "KEY_SECONDARY": "k2"}
TENANTS = f"""
[tenants.team]
keys = ["sha256:{hashlib.sha256(b"client").hexdigest()}"]
limits = [{{ tokens = 1_000_000_000, per = "day" }}, {{ requests = 1_000_000, per = "minute" }}]
"""
"""With `tenants`: the client's key names a tenant with two limits (every request is
identified, reserved, given its rate-limit headers and settled)."""

WIRES: dict[str, tuple[str, dict[str, Any]]] = {
    "messages": (
        "/v1/messages",
        {
            "model": "claude-opus-5",
            "max_tokens": 64,
            "messages": [{"role": "user", "content": "hi"}],
        },
    ),
    "chat": (
        "/v1/chat/completions",
        {"model": "gpt-5", "messages": [{"role": "user", "content": "hi"}]},
    ),
    "responses": ("/v1/responses", {"model": "gpt-5", "input": "hi"}),
}

ANSWERS: dict[str, tuple[bytes, list[bytes]]] = {
    # per wire: a JSON answer, and a stream's events, as the providers send them
    "messages": (
        b'{"id":"msg_1","type":"message","role":"assistant","model":"claude-opus-5",'
        b'"content":[{"type":"text","text":"Hello"}],"stop_reason":"end_turn",'
        b'"usage":{"input_tokens":3,"output_tokens":1}}',
        [
            b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1",'
            b'"model":"claude-opus-5","usage":{"input_tokens":3,"output_tokens":0}}}\n\n',
            b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
            b'"delta":{"type":"text_delta","text":"Hello"}}\n\n',
            b'event: message_delta\ndata: {"type":"message_delta","delta":'
            b'{"stop_reason":"end_turn"},"usage":{"output_tokens":1}}\n\n',
            b'event: message_stop\ndata: {"type":"message_stop"}\n\n',
        ],
    ),
    "chat": (
        b'{"id":"c1","object":"chat.completion","model":"gpt-5","choices":[{"index":0,'
        b'"message":{"role":"assistant","content":"Hello"},"finish_reason":"stop"}],'
        b'"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}',
        [
            b'data: {"id":"c1","object":"chat.completion.chunk","model":"gpt-5","choices":'
            b'[{"index":0,"delta":{"role":"assistant","content":"Hello"}}]}\n\n',
            b'data: {"id":"c1","object":"chat.completion.chunk","model":"gpt-5","choices":[],'
            b'"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}\n\n',
            b"data: [DONE]\n\n",
        ],
    ),
    "responses": (
        b'{"id":"r1","object":"response","model":"gpt-5","status":"completed","output":'
        b'[{"type":"message","role":"assistant","content":[{"type":"output_text",'
        b'"text":"Hello"}]}],"usage":{"input_tokens":3,"output_tokens":1,"total_tokens":4}}',
        [
            b'event: response.created\ndata: {"type":"response.created","sequence_number":0,'
            b'"response":{"id":"r1","model":"gpt-5","status":"in_progress"}}\n\n',
            b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
            b'"sequence_number":1,"delta":"Hello"}\n\n',
            b'event: response.completed\ndata: {"type":"response.completed","sequence_number":2,'
            b'"response":{"id":"r1","model":"gpt-5","status":"completed","usage":'
            b'{"input_tokens":3,"output_tokens":1,"total_tokens":4}}}\n\n',
        ],
    ),
}
