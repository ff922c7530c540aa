"""The success path's cost, held in a test: the Python-level calls one request makes through
`switchyard_stack`, counted with `sys.setprofile` ("call" and "c_call" events), per wire, JSON
and stream, a request served at once and one that fails over once.

The counts are the same on every run of one Python version (no timer fires, no clock is read
for a branch), so they are compared with budgets recorded in `call_budgets.json` beside this
file: a change that raises a count fails here; one that lowers it by more than `SLACK` fails
too, asking for the budget to come down with it. Raise a budget only with a commit message
saying what the calls buy. A Python version without recorded budgets prints its counts and
skips (`python tests/asgi/test_call_budget.py` prints them to record).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from budgets import ANSWERS, CONFIG, ENV, TENANTS, VERSION, WIRES, calls_of, check, counted_apart
from switchyard_mw.asgi._types import Message, Receive, Scope, Send
from switchyard_mw.asgi.stack import SwitchyardStack, switchyard_stack
from switchyard_mw.config import parse_config
from switchyard_mw.context import current_context

BUDGETS = Path(__file__).with_name("call_budgets.json")


class Upstream:
    """The app behind the stack: the primary answers 503 when told to fail, else a JSON answer
    or a three-event stream, the shapes a forwarding app sends."""

    def __init__(self, wire: str, *, fail_primary: bool, stream: bool) -> None:
        self.answer, self.events = ANSWERS[wire]
        self.fail_primary = fail_primary
        self.stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ctx = current_context()
        await receive()
        account = ctx.account.name if ctx is not None and ctx.account is not None else ""
        if self.fail_primary and account == "primary":
            await send({"type": "http.response.start", "status": 503, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})
            return
        kind = b"text/event-stream" if self.stream else b"application/json"
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", kind)]}
        )
        if not self.stream:
            await send({"type": "http.response.body", "body": self.answer})
            return
        for event in self.events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b""})


def scope_for(path: str) -> Scope:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"x-api-key", b"client")],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }


async def one_request(stack: SwitchyardStack, path: str, body: bytes) -> list[Message]:
    sent: list[Message] = []
    messages: Iterator[Message] = iter([{"type": "http.request", "body": body}])

    async def receive() -> Message:
        return next(messages, {"type": "http.disconnect"})

    async def send(message: Message) -> None:
        sent.append(message)

    await stack(scope_for(path), receive, send)
    return sent


def clear_of_a_minutes_end(now: float | None = None) -> float:
    """Seconds to wait so that a request starting then is not in a minute's last 5 s.

    A tenant's rate-limit headers read the time left in the per-minute window: in its last
    second OpenAI's `x-ratelimit-reset-*` is written in ms, 4 calls fewer, and a window that
    turns between the warm-up and the counted request misses the cached reset time. One
    case takes well under 5 s, so counted from the start of a minute it meets neither.
    """
    into = (time.time() if now is None else now) % 60
    return 60.05 - into if into > 55 else 0.0


def count_calls(wire: str, *, stream: bool, failover: bool, tenants: bool = False) -> int:
    """The calls of one request, after a first one has warmed every lazy part up."""
    if tenants:
        time.sleep(clear_of_a_minutes_end())
    path, payload = WIRES[wire]
    body = json.dumps({**payload, "stream": stream} if stream else payload).encode()
    upstream = Upstream(wire, fail_primary=failover, stream=stream)

    async def run() -> int:
        config = parse_config(CONFIG + "failure_threshold = 1000\n" + (TENANTS if tenants else ""))
        stack = switchyard_stack(upstream, config=config, environ=ENV, reload_on_signal=False)
        await one_request(stack, path, body)  # warm-up
        events, sent = await calls_of(one_request(stack, path, body))
        assert sent[0]["status"] == 200, sent[0]
        assert b"Hello" in b"".join(m.get("body", b"") for m in sent[1:])
        await stack.aclose()
        return events

    return asyncio.run(run())


CASES = [
    (wire, stream, failover, tenants)
    for tenants in (False, True)
    for wire in WIRES
    for stream in (False, True)
    for failover in (False, True)
]


def case_id(wire: str, stream: bool, failover: bool, tenants: bool = False) -> str:
    name = f"{wire}-{'stream' if stream else 'json'}-{'failover' if failover else 'first'}"
    return name + ("-tenants" if tenants else "")


@pytest.fixture(scope="module")
def counts() -> dict[str, int]:
    return counted_apart(Path(__file__))


def test_counts_are_the_same_run_after_run(counts: dict[str, int]) -> None:
    assert counted_apart(Path(__file__)) == counts


@pytest.mark.parametrize(
    ("into", "wait"), [(0.0, 0.0), (30.0, 0.0), (55.0, 0.0), (55.5, 4.55), (59.9, 0.15)]
)
def test_the_tenants_rows_are_counted_clear_of_a_minutes_end(into: float, wait: float) -> None:
    assert clear_of_a_minutes_end(1_800_000_000.0 + into) == pytest.approx(wait)


@pytest.mark.parametrize(
    ("wire", "stream", "failover", "tenants"), CASES, ids=[case_id(*c) for c in CASES]
)
def test_a_request_stays_within_its_call_budget(
    counts: dict[str, int], wire: str, stream: bool, failover: bool, tenants: bool
) -> None:
    name = case_id(wire, stream, failover, tenants)
    check(name, counts[name], BUDGETS)


if __name__ == "__main__":  # print the counts, as call_budgets.json records them
    found = {
        case_id(*c): count_calls(c[0], stream=c[1], failover=c[2], tenants=c[3]) for c in CASES
    }
    print(json.dumps({VERSION: found}, indent=2))
