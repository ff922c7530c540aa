"""What tenants add to a request through `switchyard_stack`, in process.

The same request (Messages and Chat, JSON and a stream) through the stack with no `[tenants]`
and with a tenant whose key the request carries and two limits (tokens a day, requests a
minute) in this process's counters: identified, permitted, reserved, given its rate-limit
headers, settled with its usage. The app behind the stack answers at once, as a provider that
costs nothing. Printed: CPU microseconds per request (the process's CPU time, not wall time),
the median of `--repeat` timings of `--number` requests each, and the difference.

    python bench/tenants_cost.py [--repeat 15] [--number 500]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import statistics
import time
from collections.abc import Iterator, MutableMapping
from typing import Any

from switchyard_mw.asgi.stack import SwitchyardStack, switchyard_stack
from switchyard_mw.config import parse_config
from switchyard_mw.context import current_context

KEY = "sk-bench"
ACCOUNTS = """
[llm_clients.a]
base_url = "http://a.test"
api_key_env = "KEY_A"
models = ["claude-opus-5", "gpt-5"]
"""
TENANTS = f"""
[tenants.bench]
keys = ["sha256:{hashlib.sha256(KEY.encode()).hexdigest()}"]
limits = [
  {{ tokens = 1_000_000_000_000, per = "day" }},
  {{ requests = 1_000_000_000, per = "minute" }},
]
"""
REQUESTS: dict[str, tuple[str, dict[str, Any], list[bytes]]] = {
    "messages": (
        "/v1/messages",
        {
            "model": "claude-opus-5",
            "max_tokens": 64,
            "messages": [{"role": "user", "content": "hi"}],
        },
        [
            b'event: message_start\ndata: {"type":"message_start","message":{"id":"m",'
            b'"model":"claude-opus-5","usage":{"input_tokens":3,"output_tokens":0}}}\n\n',
            b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
            b'"delta":{"type":"text_delta","text":"Hello"}}\n\n',
            b'event: message_delta\ndata: {"type":"message_delta","delta":{},'
            b'"usage":{"output_tokens":1}}\n\n',
        ],
    ),
    "chat": (
        "/v1/chat/completions",
        {"model": "gpt-5", "messages": [{"role": "user", "content": "hi"}]},
        [
            b'data: {"choices":[{"index":0,"delta":{"content":"Hello"}}]}\n\n',
            b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}\n\n',
            b"data: [DONE]\n\n",
        ],
    ),
}


class Provider:
    """Answers at once and reports its usage, as the forwarder does."""

    def __init__(self, stream: bool, events: list[bytes]) -> None:
        self.stream = stream
        self.events = events

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await receive()
        ctx = current_context()
        if ctx is not None:
            ctx.report_usage(input_tokens=3, output_tokens=1)
        kind = b"text/event-stream" if self.stream else b"application/json"
        headers = [(b"content-type", kind)]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        if not self.stream:
            await send({"type": "http.response.body", "body": b'{"content":[]}'})
            return
        for event in self.events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b""})


def scope_for(path: str) -> dict[str, Any]:
    return {
        "type": "http",
        "method": "POST",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"x-api-key", KEY.encode())],
    }


async def one(stack: SwitchyardStack, path: str, body: bytes) -> None:
    messages: Iterator[dict[str, Any]] = iter([{"type": "http.request", "body": body}])

    async def receive() -> dict[str, Any]:
        return next(messages, {"type": "http.disconnect"})

    async def send(message: MutableMapping[str, Any]) -> None:
        pass

    await stack(scope_for(path), receive, send)


def measure(wire: str, stream: bool, tenants: bool, repeat: int, number: int) -> float:
    path, payload, events = REQUESTS[wire]
    body = json.dumps({**payload, "stream": stream}).encode()
    config = parse_config(ACCOUNTS + (TENANTS if tenants else ""))
    stack = switchyard_stack(
        Provider(stream, events), config=config, environ={"KEY_A": "k"}, reload_on_signal=False
    )

    async def run() -> list[float]:
        for _ in range(200):
            await one(stack, path, body)
        timings = []
        for _ in range(repeat):
            started = time.process_time()
            for _ in range(number):
                await one(stack, path, body)
            timings.append((time.process_time() - started) / number * 1e6)
        await stack.aclose()
        return timings

    return statistics.median(asyncio.run(run()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--number", type=int, default=500)
    args = parser.parse_args()
    print("| request | without tenants (µs) | with tenants (µs) | added (µs) |")
    print("|---|---:|---:|---:|")
    for wire in REQUESTS:
        for stream in (False, True):
            off = measure(wire, stream, False, args.repeat, args.number)
            on = measure(wire, stream, True, args.repeat, args.number)
            shape = "stream" if stream else "JSON"
            print(f"| {wire} {shape} | {off:.1f} | {on:.1f} | {on - off:.1f} |")


if __name__ == "__main__":
    main()
