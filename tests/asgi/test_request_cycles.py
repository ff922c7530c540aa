"""A request served through `switchyard_stack` leaves no reference cycle behind.

What a request leaves in a cycle only the garbage collector frees, and every object the
collector finds costs twice: once to free, and once as a collection run sooner (served, the
example gateway's requests spent 79.0k instructions each in `gc_collect_main` against the
aiohttp floor's 4.9k). The server here is shaped as uvicorn's: the request's `receive` and
`send` are bound methods of the object that holds its scope, and the request runs in a task of
its own. With the collector off, requests are served, then one collection counts what they
left: nothing, for a success (JSON and stream), a failover, a request that outlasts
`WATCH_AFTER_SECS` (its client watched, its watcher cancelled when the response is complete),
and a hedged one (its hedge runs on a copy of the request's scope and state).
"""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import Iterator
from typing import Any

import pytest
from test_call_budget import CONFIG, ENV, WIRES, Upstream, scope_for

from switchyard_mw.asgi._disconnect import WATCH_AFTER_SECS
from switchyard_mw.asgi._types import Message, Receive, Scope, Send
from switchyard_mw.asgi.stack import SwitchyardStack, switchyard_stack
from switchyard_mw.config import parse_config
from switchyard_mw.context import current_context

REQUESTS = 10


class Cycle:
    """One request as uvicorn's `RequestResponseCycle` serves it: it holds the scope, and the
    app's `receive`/`send` are its bound methods (a cycle through the scope's state is a cycle
    through these)."""

    def __init__(self, scope: Scope, body: bytes) -> None:
        self.scope = scope
        self.body = body
        self.sent: list[Message] = []
        self.given = False
        self.done = asyncio.Event()  # the client stays until the response is complete

    async def receive(self) -> Message:
        if not self.given:
            self.given = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.done.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        self.sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self.done.set()

    async def run_asgi(self, app: SwitchyardStack) -> None:
        await app(self.scope, self.receive, self.send)


class Slow(Upstream):
    """The upstream answering after the client is watched (`WATCH_AFTER_SECS`)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await asyncio.sleep(3 * WATCH_AFTER_SECS)
        await super().__call__(scope, receive, send)


def left_in_cycles(
    wire: str,
    *,
    stream: bool,
    failover: bool,
    kind: type[Upstream] = Upstream,
    requests: int = REQUESTS,
    config_text: str = CONFIG + "failure_threshold = 1000\n",
) -> tuple[int, dict[str, int]]:
    """What `requests` requests left for the collector: how many objects, and by type."""
    path, payload = WIRES[wire]
    body = json.dumps({**payload, "stream": stream} if stream else payload).encode()
    upstream = kind(wire, fail_primary=failover, stream=stream)

    async def serve(stack: SwitchyardStack) -> None:
        cycle = Cycle(scope_for(path), body)
        await asyncio.get_running_loop().create_task(cycle.run_asgi(stack))
        assert cycle.sent[0]["status"] == 200, cycle.sent[0]
        assert b"Hello" in b"".join(m.get("body", b"") for m in cycle.sent[1:])

    async def run() -> tuple[int, dict[str, int]]:
        config = parse_config(config_text)
        stack = switchyard_stack(upstream, config=config, environ=ENV, reload_on_signal=False)
        await serve(stack)  # warm-up: every lazy part built
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds is kept, to be named
        try:
            for _ in range(requests):
                await serve(stack)
            found = gc.collect()
            kinds: dict[str, int] = {}
            for garbage in gc.garbage:
                kinds[type(garbage).__name__] = kinds.get(type(garbage).__name__, 0) + 1
        finally:
            gc.garbage.clear()
            gc.set_debug(0)
            gc.enable()
        await stack.aclose()
        return found, kinds

    return asyncio.run(run())


CASES = [
    (wire, stream, failover)
    for wire in WIRES
    for stream in (False, True)
    for failover in (False, True)
]


def _ids() -> Iterator[str]:
    for wire, stream, failover in CASES:
        yield f"{wire}-{'stream' if stream else 'json'}-{'failover' if failover else 'first'}"


@pytest.mark.parametrize(("wire", "stream", "failover"), CASES, ids=list(_ids()))
def test_a_request_leaves_no_cycle(wire: str, stream: bool, failover: bool) -> None:
    found, kinds = left_in_cycles(wire, stream=stream, failover=failover)
    assert found == 0, f"{found / REQUESTS:.1f} objects a request in cycles: {kinds}"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_request_whose_client_was_watched_leaves_no_cycle(stream: bool) -> None:
    found, kinds = left_in_cycles("messages", stream=stream, failover=False, kind=Slow, requests=3)
    assert found == 0, f"{found / 3:.1f} objects a request in cycles: {kinds}"


class Leaky(Upstream):
    """An app that leaves a cycle of its own on every request."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        loop: dict[str, Any] = {}
        loop["self"] = loop
        await super().__call__(scope, receive, send)


def test_the_count_sees_a_cycle() -> None:
    """The count is not blind: an app's cycle per request is found (one dict each)."""
    found, kinds = left_in_cycles("messages", stream=False, failover=False, kind=Leaky)
    assert found == REQUESTS
    assert kinds == {"dict": REQUESTS}


HEDGED = (
    "[server]\nhedge_max_ratio = 1.0\n"
    + CONFIG.replace("[llm_clients.primary]", "[llm_clients.primary]\nhedge_after_secs = 0.02", 1)
    + "failure_threshold = 1000\n"
)
"""The primary hedged after 20 ms onto the secondary, every request (no budget to run out)."""


class SlowPrimary(Upstream):
    """The primary's answer late enough to be hedged (the secondary answers at once)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ctx = current_context()
        if ctx is not None and ctx.account is not None and ctx.account.name == "primary":
            await asyncio.sleep(0.2)
        await super().__call__(scope, receive, send)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_hedged_request_leaves_no_cycle(stream: bool) -> None:
    found, kinds = left_in_cycles(
        "messages", stream=stream, failover=False, kind=SlowPrimary, requests=3, config_text=HEDGED
    )
    assert found == 0, f"{found / 3:.1f} objects a request in cycles: {kinds}"
