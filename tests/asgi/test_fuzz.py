"""Bad input, fuzzed through the whole ASGI stack: one well-formed answer per request, never 500.

Each case is a random or mutated body (truncated JSON, wrong types, huge numbers, deep nesting,
non-UTF-8, duplicate keys, empty, giant strings) or a bad header, sent to each wire path. The
answer must be a 2xx from the app (the body passed on, only `model` changed) or a 4xx in the
wire's error format; never a 5xx, never two starts, never a hang.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz_inputs import PATHS, header_values, mutated_bodies
from switchyard_mw.asgi.stack import switchyard_stack
from switchyard_mw.config import parse_config

CONFIG = parse_config(
    """
[server]
max_body_bytes = 65536

[llm_clients.any]
base_url = "http://127.0.0.1:9"
models = ["*"]

[canaries.m]
variants = { m2 = 50 }
"""
)


calls = {"app": 0}


async def upstream_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Stands for the gateway: reads the body it is given and answers at once."""
    calls["app"] += 1
    message = await receive()
    body = message.get("body", b"")
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": msgspec.json.encode({"len": len(body)})})


STACK = switchyard_stack(upstream_app, config=CONFIG, environ={})


async def call(
    path: str, body: bytes, headers: list[tuple[bytes, bytes]]
) -> tuple[int, bytes, int]:
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), *headers],
        "state": {},
    }
    chunks = [body[i : i + 4096] for i in range(0, len(body), 4096)] or [b""]
    messages = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]
    starts: list[int] = []
    out: list[bytes] = []

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await asyncio.Event().wait()  # the client stays; a disconnect would never come
        raise AssertionError

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            starts.append(message["status"])
        else:
            out.append(message.get("body", b""))

    async with asyncio.timeout(5):
        await STACK(scope, receive, send)
    assert len(starts) == 1, starts
    return starts[0], b"".join(out), len(starts)


def check_answer(path: str, status: int, body: bytes) -> None:
    assert status < 500, (status, body[:200])
    if status >= 400:
        assert status in (400, 413), status
        payload = json.loads(body)
        if PATHS[path] == "anthropic":
            assert payload["type"] == "error"
            assert isinstance(payload["error"]["type"], str)
            assert isinstance(payload["error"]["message"], str)
        else:
            assert payload["error"]["type"] == payload["error"]["code"]
            assert isinstance(payload["error"]["message"], str)


FUZZ = settings(
    max_examples=1700,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)


@FUZZ
@given(path=st.sampled_from(sorted(PATHS)), body=mutated_bodies())
def test_mutated_bodies_get_one_clean_answer(path: str, body: bytes) -> None:
    status, answer, _ = asyncio.run(call(path, body, []))
    check_answer(path, status, answer)


@settings(max_examples=1700, deadline=None, database=None)
@given(path=st.sampled_from(sorted(PATHS)), body=st.binary(max_size=200))
def test_random_bytes_get_one_clean_answer(path: str, body: bytes) -> None:
    status, answer, _ = asyncio.run(call(path, body, []))
    check_answer(path, status, answer)


@settings(max_examples=1700, deadline=None, database=None)
@given(
    path=st.sampled_from(sorted(PATHS)),
    name=st.sampled_from(
        [b"x-switchyard-timeout-ms", b"x-envoy-expected-rq-timeout-ms", b"content-length"]
    ),
    value=header_values,
)
def test_bad_headers_get_one_clean_answer(path: str, name: bytes, value: bytes) -> None:
    body = json.dumps({"model": "m", "max_tokens": 5, "messages": [], "input": "x"}).encode()
    status, answer, _ = asyncio.run(call(path, body, [(name, value)]))
    # A budget of 0 ms may expire at once: a clean 504 in the wire format, never a 500.
    if status == 504:
        assert b"deadline_exceeded" in answer
        return
    check_answer(path, status, answer)


def test_valid_requests_reach_the_app_with_only_model_changed() -> None:
    before = calls["app"]
    body = json.dumps({"model": "other", "max_tokens": 5, "messages": [], "x": [1, {"y": None}]})
    status, answer, _ = asyncio.run(call("/v1/messages", body.encode(), []))
    assert status == 200
    assert json.loads(answer) == {"len": len(body)}  # no canary for "other": byte for byte
    assert calls["app"] == before + 1


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/chat/completions"])
@pytest.mark.parametrize("kind", ["[]", "{}", '["text"]', "1", "null"])
def test_a_first_turn_block_whose_type_is_any_json_value_is_canaried(path: str, kind: str) -> None:
    """The canary keys a conversation on its first user turn's hash, which reads each block's
    `type`: a list or an object there is not hashable, and was a 500 (found by the read's
    Hypothesis test against msgspec's)."""
    block = f'{{"type": {kind}, "text": "x"}}'
    turn = f'{{"role": "user", "content": [{block}]}}'
    body = f'{{"model": "m", "max_tokens": 5, "messages": [{turn}]}}'
    status, answer, _ = asyncio.run(call(path, body.encode(), []))
    assert status == 200, answer[:200]
