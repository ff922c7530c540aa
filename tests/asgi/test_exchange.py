"""The request's exchange: one `send` and one `receive` between the server and the app under the
whole stack, and one timer that alone says whose a cancellation was."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from conftest import Metrics
from switchyard_mw.asgi.deadline import DeadlineMiddleware
from switchyard_mw.asgi.exchange import Exchange
from switchyard_mw.asgi.stack import switchyard_stack
from switchyard_mw.context import current_context

CONFIG = """
[llm_clients.acct-a]
base_url = "http://127.0.0.1:9"
api_key_env = "KEY_A"
models = ["m", "m-next"]
timeout_secs = 5
[canaries.m]
variants = { "m-next" = 50.0 }
"""
BODY = json.dumps({"model": "m", "max_tokens": 8, "messages": []}).encode()


def _scope() -> dict[str, Any]:
    return {
        "type": "http",
        "method": "POST",
        "path": "/v1/messages",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "state": {},
    }


def _server() -> tuple[Any, Any, list[dict[str, Any]]]:
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

    return receive, send, sent


async def test_under_the_stack_the_app_talks_to_the_server_through_one_exchange(
    tmp_path: Path,
) -> None:
    """No policy wraps `send` or `receive` again: the app's are the exchange's own methods,
    and the exchange's `send` is the server's."""
    seen: list[tuple[Any, Any]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append((receive, send))
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    path = tmp_path / "s.toml"
    path.write_text(CONFIG)
    stack = switchyard_stack(app, config=path, environ={"KEY_A": "k"})
    receive, send, sent = _server()
    await stack(_scope(), receive, send)
    [(app_receive, app_send)] = seen
    ex = app_send.__self__
    assert isinstance(ex, Exchange)
    assert app_receive.__self__ is ex
    assert ex._send is send  # the server's, with nothing between
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[0]["status"] == 200


async def test_a_deadline_with_someone_elses_cancellation_is_not_taken_back() -> None:
    """The deadline cancelled the task, and so did someone else: the exchange does not answer
    the expiry, and the other cancellation goes on."""
    answered: list[int] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            assert task is not None
            task.cancel()  # someone else's, on top of the deadline's
            raise

    mw = DeadlineMiddleware(app, timeout_secs=0.05)
    receive, send, sent = _server()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.create_task(mw(_scope(), receive, send))
    answered.extend(m["status"] for m in sent if m["type"] == "http.response.start")
    assert answered == []


async def test_a_deadline_alone_is_answered_as_the_expiry() -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        await asyncio.sleep(30)

    mw = DeadlineMiddleware(app, timeout_secs=0.05)
    receive, send, sent = _server()
    await asyncio.create_task(mw(_scope(), receive, send))
    assert sent[0]["status"] == 504
    assert json.loads(sent[1]["body"])["error"]["type"] == "deadline_exceeded"


FAILOVER = """
[llm_clients.first]
base_url = "http://127.0.0.1:9"
api_key_env = "KEY_A"
models = ["m"]
timeout_secs = 0.2
[llm_clients.second]
base_url = "http://127.0.0.1:9"
api_key_env = "KEY_A"
models = ["m"]
priority = 1
timeout_secs = 0.2
"""


async def test_a_whole_answer_held_for_a_failover_ends_its_attempts_deadline(
    tmp_path: Path, otel_metrics: Metrics
) -> None:
    """The first account's 503 is whole and held (a failover may follow): its attempt's deadline
    ends with it, so an app that lingers past that deadline before it returns is not cut, and
    the second account answers."""
    lingered: list[str] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        ctx = current_context()
        assert ctx is not None
        assert ctx.account is not None
        if ctx.account.name == "first":
            await send({"type": "http.response.start", "status": 503, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})
            await asyncio.sleep(0.5)  # past the attempt's deadline (about 0.2 s)
            lingered.append(ctx.account.name)
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b'{"ok":true}'})

    before = otel_metrics.value("switchyard.deadline.exceeded", phase="total")
    path = tmp_path / "s.toml"
    path.write_text(FAILOVER)
    stack = switchyard_stack(app, config=path, environ={"KEY_A": "k"})
    receive, send, sent = _server()
    await asyncio.create_task(stack(_scope(), receive, send))
    assert lingered == ["first"]
    assert [(m["type"], m.get("status")) for m in sent] == [
        ("http.response.start", 200),
        ("http.response.body", None),
    ]
    assert sent[1]["body"] == b'{"ok":true}'
    assert otel_metrics.value("switchyard.deadline.exceeded", phase="total") == before
