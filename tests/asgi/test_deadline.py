"""The deadline policy: the formula at its boundaries, and its enforcement on the app."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from conftest import Metrics
from switchyard_mw.accounts import Account
from switchyard_mw.asgi._disconnect import LISTENER_GRACE_SECS
from switchyard_mw.asgi.deadline import DeadlineMiddleware
from switchyard_mw.clients.outbound import BACKSTOP_SECS, timeout_for
from switchyard_mw.config import LLMClient
from switchyard_mw.context import RequestContext, context_of, current_context
from switchyard_mw.core.deadline_math import attempt_deadline_secs, parse_budget_ms
from switchyard_mw.engine.answers import deadline_exceeded

App = Callable[[dict[str, Any], Any, Any], Awaitable[None]]

# --- the formula -----------------------------------------------------------------------------

TABLE = [
    # (max_tokens, timeout_secs, expected deadline seconds)
    (0, 1, 1.0),
    (0, 60, 60.0),
    (0, 900, 900.0),
    (100, 1, 2.8125),
    (100, 60, 60.0),
    (100, 900, 900.0),
    (16384, 1, 460.8),
    (16384, 60, 460.8),
    (16384, 900, 900.0),
    (32000, 1, 600.0),
    (32000, 60, 600.0),
    (32000, 900, 900.0),
]


@pytest.mark.parametrize(("max_tokens", "timeout", "expected"), TABLE)
def test_formula_table(max_tokens: int, timeout: float, expected: float) -> None:
    got = attempt_deadline_secs(timeout_secs=timeout, max_tokens=max_tokens)
    assert got == pytest.approx(expected)


def test_formula_boundaries() -> None:
    # The cap: 600 s is reached at exactly 128000 * 600 / 3600 = 21333.3 tokens.
    assert attempt_deadline_secs(timeout_secs=1, max_tokens=21334) == 600.0
    assert attempt_deadline_secs(timeout_secs=1, max_tokens=21333) < 600.0
    assert attempt_deadline_secs(timeout_secs=1, max_tokens=10**9) == 600.0
    # A floor above the cap holds.
    assert attempt_deadline_secs(timeout_secs=601, max_tokens=10**9) == 601.0
    # No cap in the request: the client's default, else 0.
    assert attempt_deadline_secs(timeout_secs=1, max_tokens=None, default_max_tokens=16384) == 460.8
    assert attempt_deadline_secs(timeout_secs=1, max_tokens=None) == 1.0
    # The request's own cap wins over the default, even when smaller.
    assert attempt_deadline_secs(timeout_secs=1, max_tokens=100, default_max_tokens=16384) == 2.8125


def test_docs_table_matches_the_code() -> None:
    from pathlib import Path

    page = (Path(__file__).parents[2] / "docs" / "policies" / "deadline.md").read_text()
    table = page.split("<!-- deadline-table")[1].split("-->", 1)[1]
    section = table.split("<!-- /deadline-table -->")[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 4
    for row in rows:
        cells = [c.strip().removesuffix(" s") for c in row.strip("|").split("|")]
        max_tokens = int(cells[0])
        for timeout, cell in zip((1, 60, 900), cells[1:], strict=True):
            expected = attempt_deadline_secs(timeout_secs=timeout, max_tokens=max_tokens)
            assert float(cell) == pytest.approx(expected), row


@pytest.mark.parametrize(
    ("raw", "secs"),
    [(b"1500", 1.5), (b" 250 ", 0.25), (b"0", 0.0), ("12.5", 0.0125)],
)
def test_budget_header_values(raw: bytes | str, secs: float) -> None:
    assert parse_budget_ms(raw) == pytest.approx(secs)


@pytest.mark.parametrize("raw", [b"", b"-1", b"abc", b"nan", b"inf", b"1e400", b"9" * 40])
def test_invalid_budget_values_are_rejected(raw: bytes) -> None:
    assert parse_budget_ms(raw) is None


# --- enforcement -----------------------------------------------------------------------------


CHUNK = (
    b'data: {"type":"content_block_delta","delta":{"type":"text_delta","text":"x"},'
    b'"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n'
)
"""A stream's chunk: one content event as both Anthropic and Chat read it (a stream starts at
its first content event, and its start is held back until then)."""
CHUNK_EVENT = CHUNK.decode().removesuffix("\n\n")


def sleeper(
    *, before_start: float = 0.0, sse_gaps: list[float] | None = None
) -> tuple[App, dict[str, Any]]:
    """An app that waits, then answers JSON or a stream with the given gaps between chunks."""
    state: dict[str, Any] = {"finally": False, "cancelled": False, "deadline": None}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        ctx = current_context()
        state["deadline"] = ctx.seconds_left if ctx else None
        try:
            await asyncio.sleep(before_start)
            if sse_gaps is None:
                await send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": [(b"content-type", b"application/json")],
                    }
                )
                await send({"type": "http.response.body", "body": b'{"ok": true}'})
                return
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")],
                }
            )
            for gap in sse_gaps:
                await asyncio.sleep(gap)
                await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            state["cancelled"] = True
            raise
        finally:
            state["finally"] = True

    return app, state


def post(
    mw: Any, path: str, payload: dict[str, Any], headers: dict[str, str] | None = None
) -> Awaitable[httpx.Response]:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(mw), base_url="http://t") as c:
            return await c.post(path, json=payload, headers=headers or {})

    return go()


async def test_fast_app_passes_and_sees_its_deadline() -> None:
    app, state = sleeper()
    mw = DeadlineMiddleware(app, timeout_secs=1.0)
    r = await post(mw, "/v1/messages", {"model": "m", "max_tokens": 100})
    assert r.status_code == 200
    assert r.headers["x-switchyard-deadline-ms"] == "2812"
    assert 2.0 < state["deadline"] <= 2.8125


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/chat/completions", "/v1/responses"])
async def test_504_in_the_wire_format_before_start_and_app_cancelled(
    path: str, otel_metrics: Metrics
) -> None:
    before = otel_metrics.value("switchyard.deadline.exceeded", phase="total")
    app, state = sleeper(before_start=5)
    mw = DeadlineMiddleware(app, timeout_secs=0.1)
    started = time.monotonic()
    r = await post(mw, path, {"model": "m", "max_tokens": 1, "max_output_tokens": 1})
    assert time.monotonic() - started < 2
    assert r.status_code == 504
    body = r.json()
    if path == "/v1/messages":
        assert body == {
            "type": "error",
            "error": {"type": "deadline_exceeded", "message": body["error"]["message"]},
        }
    else:
        assert body["error"]["type"] == body["error"]["code"] == "deadline_exceeded"
    assert state["cancelled"]
    assert state["finally"]
    assert otel_metrics.value("switchyard.deadline.exceeded", phase="total") == before + 1


async def test_larger_output_cap_buys_time() -> None:
    # 0.15 s of work: 10 tokens (0.28 s) is enough at a 0.1 s floor, 1 token (0.1 s) is not.
    app, _ = sleeper(before_start=0.15)
    mw = DeadlineMiddleware(app, timeout_secs=0.1)
    assert (await post(mw, "/v1/messages", {"model": "m", "max_tokens": 10})).status_code == 200
    assert (await post(mw, "/v1/messages", {"model": "m", "max_tokens": 1})).status_code == 504


async def test_stream_that_never_starts_gets_504_headers_phase(otel_metrics: Metrics) -> None:
    before = otel_metrics.value("switchyard.deadline.exceeded", phase="headers")
    app, _ = sleeper(before_start=5, sse_gaps=[])
    mw = DeadlineMiddleware(app, timeout_secs=0.1, stream_idle_secs=5)
    r = await post(mw, "/v1/chat/completions", {"model": "m", "stream": True, "max_tokens": 10**6})
    assert r.status_code == 504
    assert otel_metrics.value("switchyard.deadline.exceeded", phase="headers") == before + 1


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/chat/completions"])
async def test_stalled_stream_ends_with_one_wire_error_event(
    path: str, otel_metrics: Metrics
) -> None:
    before = otel_metrics.value("switchyard.deadline.exceeded", phase="idle")
    app, state = sleeper(sse_gaps=[0.0, 0.0, 5.0])
    mw = DeadlineMiddleware(app, timeout_secs=1, stream_idle_secs=0.2)
    r = await post(mw, path, {"model": "m", "stream": True})
    assert r.status_code == 200
    events = r.text.split("\n\n")
    assert events[:2] == [CHUNK_EVENT, CHUNK_EVENT]
    last = events[2]
    if path == "/v1/messages":
        assert last.startswith("event: error\ndata: ")
        payload = json.loads(last.split("data: ", 1)[1])
        assert payload["type"] == "error"
        assert payload["error"]["type"] == "deadline_exceeded"
    else:
        payload = json.loads(last.removeprefix("data: "))
        assert payload["error"]["type"] == "deadline_exceeded"
    assert r.text.count("deadline_exceeded") == (1 if path == "/v1/messages" else 2)  # type+code
    assert state["cancelled"]
    assert state["finally"]
    assert otel_metrics.value("switchyard.deadline.exceeded", phase="idle") == before + 1


@pytest.mark.parametrize("piece_bytes", [1, 7, 64, 10_000])
async def test_a_stalled_responses_stream_ends_with_its_own_numbered_error_event(
    piece_bytes: int,
) -> None:
    """The app's pieces cut events anywhere (inside the key, between digits): the error event
    still follows the last event that passed, as the Responses wire numbers them."""
    events = b"".join(
        b"event: response.output_text.delta\ndata: "
        + json.dumps({"type": "response.output_text.delta", "delta": "x", "sequence_number": n})
        .replace(" ", "")
        .encode()
        + b"\n\n"
        for n in range(40, 53)
    )

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        start = {"type": "http.response.start", "status": 200}
        await send({**start, "headers": [(b"content-type", b"text/event-stream")]})
        for at in range(0, len(events), piece_bytes):
            piece = events[at : at + piece_bytes]
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await asyncio.sleep(5)

    mw = DeadlineMiddleware(app, timeout_secs=1, stream_idle_secs=0.2)
    r = await post(mw, "/v1/responses", {"model": "m", "input": "hi", "stream": True})
    assert r.status_code == 200
    assert r.content.startswith(events)
    name, data = r.content[len(events) :].removesuffix(b"\n\n").split(b"\n")
    assert name == b"event: error"
    error = deadline_exceeded("idle")
    assert json.loads(data.removeprefix(b"data: ")) == {
        "type": "error",
        "code": error.error_type,
        "message": error.message,
        "param": None,
        "sequence_number": 53,
    }


async def test_steady_slow_stream_outlives_the_idle_cap_many_times() -> None:
    # Chunks every 0.5 x idle: total 1.2 s, far beyond the 0.2 s idle cap and the 0.3 s start bound.
    app, state = sleeper(sse_gaps=[0.1] * 12)
    mw = DeadlineMiddleware(app, timeout_secs=0.3, stream_idle_secs=0.2)
    r = await post(mw, "/v1/messages", {"model": "m", "stream": True})
    assert r.status_code == 200
    assert r.text.count(CHUNK_EVENT) == 12
    assert "error" not in r.text
    assert not state["cancelled"]


async def test_budget_header_wins_over_a_longer_attempt_deadline(otel_metrics: Metrics) -> None:
    before = otel_metrics.value("switchyard.deadline.exceeded", phase="budget")
    app, state = sleeper(before_start=5)
    mw = DeadlineMiddleware(app, timeout_secs=10)
    started = time.monotonic()
    r = await post(mw, "/v1/messages", {"model": "m"}, headers={"x-switchyard-timeout-ms": "150"})
    assert time.monotonic() - started < 2
    assert r.status_code == 504
    assert state["deadline"] <= 0.15
    assert otel_metrics.value("switchyard.deadline.exceeded", phase="budget") == before + 1


async def test_envoy_budget_header_and_the_shorter_budget_wins() -> None:
    app, state = sleeper()
    mw = DeadlineMiddleware(app, timeout_secs=10)
    headers = {"x-envoy-expected-rq-timeout-ms": "3000", "x-switchyard-timeout-ms": "9000"}
    r = await post(mw, "/v1/messages", {"model": "m"}, headers=headers)
    assert r.status_code == 200
    assert 2.0 < state["deadline"] <= 3.0


@pytest.mark.parametrize(
    ("headers", "stream", "low", "high"),
    [
        ({}, False, 60000, 60000),
        ({"x-switchyard-timeout-ms": "90000"}, False, 60000, 60000),  # longer: the attempt's
        ({"x-switchyard-timeout-ms": "3000"}, False, 2500, 3000),  # shorter: what is left of it
        ({"x-envoy-expected-rq-timeout-ms": "3000"}, False, 2500, 3000),
        ({"x-switchyard-timeout-ms": "3000"}, True, 2500, 3000),  # a stream's time to start
        ({"x-switchyard-timeout-ms": "90000"}, True, 60000, 60000),
    ],
)
async def test_the_deadline_header_reports_the_deadline_in_force(
    headers: dict[str, str], stream: bool, low: int, high: int
) -> None:
    app, _ = sleeper(sse_gaps=[0.0] if stream else None)
    mw = DeadlineMiddleware(app, timeout_secs=60)
    body = {"model": "m", "max_tokens": 100, "stream": stream}
    r = await post(mw, "/v1/messages", body, headers=headers)
    assert r.status_code == 200
    assert low <= int(r.headers["x-switchyard-deadline-ms"]) <= high


async def test_invalid_budget_is_ignored_and_counted(otel_metrics: Metrics) -> None:
    before = otel_metrics.value("switchyard.budget.invalid")
    app, state = sleeper()
    mw = DeadlineMiddleware(app, timeout_secs=1)
    r = await post(mw, "/v1/messages", {"model": "m"}, headers={"x-switchyard-timeout-ms": "-5"})
    assert r.status_code == 200
    assert state["deadline"] > 0.5
    assert otel_metrics.value("switchyard.budget.invalid") == before + 1


async def test_limits_come_from_the_chosen_client() -> None:
    seen: dict[str, Any] = {}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        seen["timeout"] = timeout_for(current_context())
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    account = Account(
        name="a",
        spec=LLMClient(base_url="http://x", models=["m"], timeout_secs=7, default_max_tokens=32000),
    )

    async def with_client(scope: dict[str, Any], receive: Any, send: Any) -> None:
        ctx = context_of(scope)
        assert ctx is not None
        ctx.account = account
        await deadline(scope, receive, send)

    deadline = DeadlineMiddleware(app, timeout_secs=1)
    from switchyard_mw.asgi.variant import VariantMiddleware

    outer = VariantMiddleware(with_client, canaries={})
    r = await post(outer, "/v1/messages", {"model": "m"})
    assert r.headers["x-switchyard-deadline-ms"] == "600000"  # default_max_tokens 32000 -> 600 s
    # The policy's alarm decides; the call's own bound is a backstop just past it.
    assert 590 + BACKSTOP_SECS < seen["timeout"].read <= 600 + BACKSTOP_SECS


def timeout_seen_by_app() -> tuple[App, dict[str, httpx.Timeout]]:
    seen: dict[str, httpx.Timeout] = {}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        seen["timeout"] = timeout_for(current_context())
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    return app, seen


@pytest.mark.parametrize(
    ("budget_ms", "start", "read"),
    [
        # The start by what is left of timeout_secs, each read by the idle limit (the larger,
        # as httpx's read bound covers the wait for the response's start too)...
        (None, 2.0, 7.0),
        # ...both cut short by the budget.
        ("3000", 2.0, 3.0),
        ("1000", 1.0, 1.0),
    ],
)
async def test_timeout_for_a_stream_bounds_each_read_by_the_idle_limit(
    budget_ms: str | None, start: float, read: float
) -> None:
    app, seen = timeout_seen_by_app()
    mw = DeadlineMiddleware(app, timeout_secs=2, stream_idle_secs=7)
    headers = {"x-switchyard-timeout-ms": budget_ms} if budget_ms else {}
    await post(mw, "/v1/messages", {"model": "m", "stream": True}, headers=headers)
    timeout = seen["timeout"]
    assert timeout.connect == timeout.pool == timeout.write
    assert timeout.connect == pytest.approx(start + BACKSTOP_SECS, abs=0.1)
    assert timeout.read == pytest.approx(read + BACKSTOP_SECS, abs=0.1)


def test_timeout_for_without_the_deadline_policy_is_the_only_bound() -> None:
    assert timeout_for(None, default_secs=9) == httpx.Timeout(9)
    ctx = RequestContext()
    ctx.budget_at = ctx.started_at + 100  # a budget read by the base, no alarm armed
    timeout = timeout_for(ctx)
    assert 99 < timeout.read == timeout.connect <= 100  # no backstop: nothing to back up


async def test_app_timeout_error_of_its_own_is_not_ours() -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        raise TimeoutError("the app's own")

    mw = DeadlineMiddleware(app, timeout_secs=5)
    with pytest.raises(TimeoutError, match="the app's own"):
        await post(mw, "/v1/messages", {"model": "m"})


async def test_alarm_moved_later_fires_at_the_new_time_and_earlier_re_arms() -> None:
    from switchyard_mw.asgi.exchange import Exchange, Expiry
    from switchyard_mw.wire import Wire, read_request

    body = b'{"model": "m", "messages": []}'

    async def never() -> dict[str, Any]:
        await asyncio.Event().wait()
        raise AssertionError

    async def discard(message: Any) -> None:
        pass

    def timer(task: asyncio.Task[Any]) -> Exchange:
        loop = asyncio.get_running_loop()
        ex = Exchange(never, discard, loop, task, None, time.monotonic())
        ex.read(RequestContext(read_request(Wire.ANTHROPIC, body), body))
        ex.arm(0.05, None, time.monotonic())
        return ex

    target = asyncio.create_task(asyncio.sleep(30))
    alarm = timer(target)
    alarm.move(0.3)  # later: the first timer must not fire the alarm
    await asyncio.sleep(0.15)
    assert alarm.expiry is Expiry.PENDING
    assert not target.done()
    alarm.move(0.05)  # earlier than 0.3: re-armed
    await asyncio.sleep(0.2)
    assert alarm.expiry is Expiry.CANCELLED
    assert target.cancelled()
    alarm.stop()
    other = asyncio.create_task(asyncio.sleep(30))
    disarmed = timer(other)
    disarmed.disarm()
    await asyncio.sleep(0.1)
    assert disarmed.expiry is Expiry.PENDING
    assert not other.done()
    other.cancel()
    disarmed.stop()


# --- cancelling the app's work in a framework that listens for a disconnect itself -----------


def listening_app(*, ends_when_told: bool = True) -> tuple[App, dict[str, Any]]:
    """An app shaped as Django's ASGI handler (`ASGIHandler.handle`): the view runs in a task
    of its own beside one that waits for `http.disconnect`; whichever ends first, the other is
    cancelled. `ends_when_told=False`: an app that listens but then waits for its view anyway.
    `state["view"]` says how the view ended; `state["view_at"]` when (loop time)."""
    state: dict[str, Any] = {"view": "running", "view_at": None, "heard": None}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        loop = asyncio.get_running_loop()

        async def listen() -> None:
            state["heard"] = (await receive())["type"]

        async def view() -> None:
            try:
                await asyncio.sleep(30)  # the upstream call
            except asyncio.CancelledError:
                state["view"], state["view_at"] = "cancelled", loop.time()
                raise
            state["view"] = "finished"

        listener, work = asyncio.create_task(listen()), asyncio.create_task(view())
        if not ends_when_told:
            await work
            return
        await asyncio.wait((listener, work), return_when=asyncio.FIRST_COMPLETED)
        for task in (listener, work):
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    return app, state


async def test_an_app_that_listens_for_a_disconnect_is_told_and_ends_its_view() -> None:
    """As Django: the deadline must not cancel the app's task while it waits on its view and
    its listener (the view would run on); the listener hears `http.disconnect`, the app
    cancels its view, and the client gets the 504 without waiting out the grace."""
    app, state = listening_app()
    mw = DeadlineMiddleware(app, timeout_secs=0.3)
    loop = asyncio.get_running_loop()
    started = loop.time()
    r = await post(mw, "/v1/messages", {"model": "m", "max_tokens": 1})
    answered = loop.time()
    assert r.status_code == 504
    assert r.json()["error"]["type"] == "deadline_exceeded"
    assert state["heard"] == "http.disconnect"
    assert state["view"] == "cancelled"
    assert 0.3 <= state["view_at"] - started < 0.3 + LISTENER_GRACE_SECS
    assert answered - started < 0.3 + LISTENER_GRACE_SECS


async def test_an_app_that_listens_but_goes_on_is_cancelled_after_the_grace() -> None:
    app, state = listening_app(ends_when_told=False)
    mw = DeadlineMiddleware(app, timeout_secs=0.3)
    loop = asyncio.get_running_loop()
    started = loop.time()
    r = await post(mw, "/v1/messages", {"model": "m", "max_tokens": 1})
    assert r.status_code == 504
    assert state["heard"] == "http.disconnect"
    assert state["view"] == "cancelled"
    assert 0.3 + LISTENER_GRACE_SECS <= state["view_at"] - started < 2


async def test_after_the_deadline_receive_says_the_client_left() -> None:
    """An app that swallows the cancellation and asks `receive` again hears
    `http.disconnect` (it would wait for ever); it sends nothing, so the 504 is still sent."""
    heard: list[str] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            heard.append((await asyncio.wait_for(receive(), 2))["type"])

    mw = DeadlineMiddleware(app, timeout_secs=0.1)
    r = await post(mw, "/v1/messages", {"model": "m", "max_tokens": 1})
    assert heard == ["http.disconnect"]
    assert r.status_code == 504
    assert r.json()["error"]["type"] == "deadline_exceeded"


async def test_a_listening_app_with_a_started_stream_gets_the_error_event() -> None:
    """The listener told after the stream started: the app cancels its view, returns, and the
    stream ends with the wire's error event."""
    state: dict[str, Any] = {"view": "running"}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()

        async def listen() -> None:
            await receive()

        async def view() -> None:
            headers = [(b"content-type", b"text/event-stream")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                state["view"] = "cancelled"
                raise

        tasks = (asyncio.create_task(listen()), asyncio.create_task(view()))
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    mw = DeadlineMiddleware(app, timeout_secs=1, stream_idle_secs=0.2)
    r = await post(mw, "/v1/chat/completions", {"model": "m", "stream": True})
    assert r.status_code == 200
    events = r.text.split("\n\n")
    assert events[0] == CHUNK_EVENT
    assert json.loads(events[1].removeprefix("data: "))["error"]["type"] == "deadline_exceeded"
    assert state["view"] == "cancelled"


async def test_cleanup_that_waits_again_is_cancelled_again() -> None:
    """A cancellation ends one wait; cleanup that waits again (Django joining a sync view's
    thread) is cancelled again LISTENER_GRACE_SECS later, so the 504 does not wait for it."""
    cleaned: list[str] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        try:
            await asyncio.sleep(30)
        finally:
            try:
                await asyncio.sleep(30)  # a join of work that cannot be interrupted
            finally:
                cleaned.append("cut short")

    mw = DeadlineMiddleware(app, timeout_secs=0.2)
    loop = asyncio.get_running_loop()
    started = loop.time()
    r = await post(mw, "/v1/messages", {"model": "m", "max_tokens": 1})
    elapsed = loop.time() - started
    assert r.status_code == 504
    assert cleaned == ["cut short"]
    assert 0.2 + LISTENER_GRACE_SECS <= elapsed < 0.2 + 2 * LISTENER_GRACE_SECS + 0.5


# --- a stream starts at its first content event ----------------------------------------------

OPENING = b'event: message_start\ndata: {"type":"message_start","message":{}}\n\nevent: ping\ndata: {"type":"ping"}\n\n'  # noqa: E501


def opens_then(content_after: float, then: bytes = CHUNK) -> App:
    """A stream that sends its headers and opening events at once, its content later."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": OPENING, "more_body": True})
        await asyncio.sleep(content_after)
        await send({"type": "http.response.body", "body": then, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


async def test_no_content_in_time_is_a_504_with_nothing_of_the_stream(
    otel_metrics: Metrics,
) -> None:
    before = otel_metrics.value("switchyard.deadline.exceeded", phase="first_token")
    mw = DeadlineMiddleware(opens_then(5.0), timeout_secs=0.3, stream_idle_secs=30)
    started = time.monotonic()
    r = await post(mw, "/v1/messages", {"model": "m", "stream": True})
    assert time.monotonic() - started < 2.0
    # The headers and opening events were held: the client gets the expiry as its answer.
    assert r.status_code == 504
    assert r.json()["error"]["type"] == "deadline_exceeded"
    assert r.json()["error"]["message"] == deadline_exceeded("first_token").message
    assert b"message_start" not in r.content
    assert otel_metrics.value("switchyard.deadline.exceeded", phase="first_token") == before + 1


async def test_content_in_time_lets_the_held_opening_through_in_order() -> None:
    mw = DeadlineMiddleware(opens_then(0.1), timeout_secs=1.0, stream_idle_secs=30)
    r = await post(mw, "/v1/messages", {"model": "m", "stream": True})
    assert r.status_code == 200
    assert r.content == OPENING + CHUNK


async def test_a_stream_that_ends_before_any_content_goes_on_as_it_is() -> None:
    error = b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error"}}\n\n'
    mw = DeadlineMiddleware(opens_then(0.0, then=error), timeout_secs=1.0, stream_idle_secs=30)
    r = await post(mw, "/v1/messages", {"model": "m", "stream": True})
    assert r.status_code == 200
    assert r.content == OPENING + error


async def test_timeout_for_never_cuts_a_stream_before_its_first_token_is_due() -> None:
    app, seen = timeout_seen_by_app()
    # Its first content may come 9 s in: past timeout_secs (2) and stream_idle_secs (3).
    account = Account(
        name="a",
        spec=LLMClient(
            base_url="http://x",
            models=["m"],
            timeout_secs=2,
            stream_idle_secs=3,
            first_token_secs=9,
        ),
    )

    async def with_client(scope: dict[str, Any], receive: Any, send: Any) -> None:
        ctx = context_of(scope)
        assert ctx is not None
        ctx.account = account
        await deadline(scope, receive, send)

    deadline = DeadlineMiddleware(app, timeout_secs=1)
    from switchyard_mw.asgi.variant import VariantMiddleware

    outer = VariantMiddleware(with_client, canaries={})
    await post(outer, "/v1/messages", {"model": "m", "stream": True})
    assert seen["timeout"].read == pytest.approx(9 + BACKSTOP_SECS, abs=0.1)
