"""What every switchyard middleware shares: reading once, 400/413, pass-through, the context."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from switchyard_mw.asgi.variant import VariantMiddleware
from switchyard_mw.config import Canary, Server
from switchyard_mw.context import RequestContext, context_of, current_context

CANARIES = {"base": Canary(variants={"v": 100.0})}


async def _nested_model() -> str | None:
    await asyncio.sleep(0)
    ctx = current_context()
    return ctx.resolved_model if ctx else None


async def endpoint(request: Request) -> JSONResponse:
    body = await request.json()
    ctx = request.state.switchyard
    assert isinstance(ctx, RequestContext)
    assert context_of(request.scope) is ctx
    return JSONResponse(
        {
            "model_in_body": body.get("model"),
            "ctx_model": ctx.resolved_model,
            "nested_model": await _nested_model(),
            "requested": ctx.requested_model,
        }
    )


async def echo_raw(request: Request) -> JSONResponse:
    raw = await request.body()
    has_ctx = getattr(request.state, "switchyard", None) is not None
    view = request.state.switchyard.view if has_ctx else None
    return JSONResponse({"raw": raw.decode("latin-1"), "view": view is not None})


app = Starlette(
    routes=[
        Route("/v1/messages", endpoint, methods=["POST"]),
        Route("/v1/chat/completions", endpoint, methods=["POST"]),
        Route("/v1/responses", endpoint, methods=["POST"]),
        Route("/other", echo_raw, methods=["POST"]),
        Route("/v1/custom", echo_raw, methods=["POST"]),
    ]
)


def client(server: Server | None = None) -> httpx.AsyncClient:
    mw = VariantMiddleware(app, canaries=CANARIES, server=server)
    return httpx.AsyncClient(transport=httpx.ASGITransport(mw), base_url="http://test")


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/chat/completions", "/v1/responses"])
async def test_context_reaches_endpoint_and_nested_coroutine(path: str) -> None:
    async with client() as c:
        r = await c.post(
            path,
            json={
                "model": "base",
                "messages": [],
                "input": "hi",
                "user": "u",
                "metadata": {"user_id": "u"},
            },
        )
    assert r.status_code == 200
    assert r.json() == {
        "model_in_body": "v",
        "ctx_model": "v",
        "nested_model": "v",
        "requested": "base",
    }
    assert r.headers["x-switchyard-model"] == "v"


async def test_context_var_is_reset_after_the_request() -> None:
    async with client() as c:
        await c.post("/v1/messages", json={"model": "base", "messages": []})
    assert current_context() is None


@pytest.mark.parametrize(
    ("path", "anthropic"),
    [("/v1/messages", True), ("/v1/chat/completions", False), ("/v1/responses", False)],
)
async def test_malformed_json_is_400_in_the_wire_format(path: str, anthropic: bool) -> None:
    async with client() as c:
        r = await c.post(
            path, content=b'{"model": "m", ', headers={"content-type": "application/json"}
        )
    assert r.status_code == 400
    if anthropic:
        assert r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "invalid_request_error"
    else:
        assert r.json()["error"]["code"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("path", "anthropic"), [("/v1/messages", True), ("/v1/chat/completions", False)]
)
async def test_body_over_the_limit_is_413_in_the_wire_format(path: str, anthropic: bool) -> None:
    big = json.dumps({"model": "m", "pad": "x" * 2000}).encode()
    async with client(Server(max_body_bytes=1000)) as c:
        r = await c.post(path, content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413
    error = r.json()["error"]
    assert error["type"] == "request_too_large"
    assert ("code" in error) is not anthropic


async def test_413_counts_streamed_chunks_without_content_length() -> None:
    async def chunks() -> Any:
        for _ in range(5):
            yield b"x" * 400

    async with client(Server(max_body_bytes=1000)) as c:
        r = await c.post(
            "/v1/messages", content=chunks(), headers={"content-type": "application/json"}
        )
    assert r.status_code == 413


async def test_unknown_paths_pass_through_untouched() -> None:
    async with client() as c:
        r = await c.post(
            "/other", content=b'{"model": "base", ', headers={"content-type": "application/json"}
        )
    assert r.status_code == 200
    assert r.json() == {"raw": '{"model": "base", ', "view": False}


async def test_non_json_body_on_a_wire_path_passes_through_unread() -> None:
    seen: list[bytes] = []

    async def raw_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    mw = VariantMiddleware(raw_app, canaries=CANARIES)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(mw), base_url="http://t") as c:
        r = await c.post(
            "/v1/messages", content=b"not json {", headers={"content-type": "text/plain"}
        )
    assert r.status_code == 204
    assert seen == [b"not json {"]


async def test_a_repeated_header_counts_by_its_first_value() -> None:
    """The owner reads content-type, content-length and the budget headers by their first
    value, as a server hands them over (a later duplicate changes nothing)."""
    seen: list[RequestContext] = []

    async def raw_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append(scope["state"]["switchyard"])
        await receive()
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    body = json.dumps({"model": "base", "messages": []}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-type", b"text/plain"),  # would make the body pass through unread
        (b"x-switchyard-timeout-ms", b"30000"),
        (b"x-switchyard-timeout-ms", b"1"),
        (b"content-length", str(len(body)).encode()),
    ]
    scope = {"type": "http", "method": "POST", "path": "/v1/messages", "headers": headers}
    sent: list[dict[str, Any]] = []
    request = {"type": "http.request", "body": body, "more_body": False}

    async def receive() -> dict[str, Any]:
        return request

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await VariantMiddleware(raw_app, canaries=CANARIES)(scope, receive, send)
    assert sent[0]["status"] == 204
    ctx = seen[0]
    assert ctx.view is not None  # read as JSON: the first content-type counted
    assert ctx.budget_at is not None
    assert ctx.budget_at - ctx.started_at == pytest.approx(30.0)


async def test_generic_paths_are_read_for_their_model() -> None:
    async with client(Server(generic_paths=["/v1/custom"])) as c:
        r = await c.post("/v1/custom", json={"model": "base", "user": "u", "anything": 1})
    assert r.status_code == 200
    assert json.loads(r.json()["raw"])["model"] == "v"
    assert r.json()["view"] is True


async def test_lifespan_and_websocket_scopes_pass_straight_through() -> None:
    seen: list[str] = []

    async def inner(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append(scope["type"])
        assert "switchyard" not in scope.get("state", {})

    mw = VariantMiddleware(inner, canaries=CANARIES)
    for kind in ("lifespan", "websocket"):
        await mw({"type": kind, "state": {}}, _never, _discard)
    assert seen == ["lifespan", "websocket"]


async def _never() -> dict[str, Any]:
    await asyncio.Event().wait()
    raise AssertionError


async def _discard(message: dict[str, Any]) -> None:
    return None


def _messages_scope() -> dict[str, Any]:
    """A fresh scope of a JSON POST to /v1/messages, as a server makes one per request."""
    return {
        "type": "http",
        "method": "POST",
        "path": "/v1/messages",
        "headers": [(b"content-type", b"application/json")],
        "state": {},
    }


def _replaying(first: dict[str, Any]) -> Any:
    """A server's `receive`: `first`, then nothing until the client leaves (never, here)."""
    messages = [first]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await asyncio.Event().wait()
        raise AssertionError

    return receive


async def test_client_disconnect_cancels_the_app_and_its_finally_runs() -> None:
    finally_ran = asyncio.Event()
    started = asyncio.Event()

    async def slow_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        started.set()
        try:
            await asyncio.sleep(30)  # an upstream call that would run on for a gone client
        finally:
            finally_ran.set()

    messages = [
        {"type": "http.request", "body": b'{"model": "m", "messages": []}', "more_body": False}
    ]
    disconnect = asyncio.Event()

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await disconnect.wait()
        return {"type": "http.disconnect"}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = _messages_scope()
    mw = VariantMiddleware(slow_app, canaries=CANARIES)
    task = asyncio.create_task(mw(scope, receive, send))
    await asyncio.wait_for(started.wait(), 5)
    disconnect.set()
    await asyncio.wait_for(task, 5)  # returns cleanly: nobody left to answer
    assert finally_ran.is_set()
    assert sent == []
    ctx = context_of(scope)
    assert ctx is not None
    assert ctx.disconnected


async def test_client_disconnect_reaches_an_app_that_listens_in_a_task_of_its_own() -> None:
    """Shaped as Django's ASGI handler: the view in one task, a listener for
    `http.disconnect` in another. The listener must hear the disconnect before the request's
    task is cancelled: cancelled first, the app stops waiting and its view runs on."""
    view_ended: list[str] = []
    started = asyncio.Event()

    async def django_like(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()

        async def listen() -> None:
            await receive()

        async def view() -> None:
            started.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                view_ended.append("cancelled")
                raise

        tasks = (asyncio.create_task(listen()), asyncio.create_task(view()))
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    body = {"type": "http.request", "body": b'{"model": "m", "messages": []}', "more_body": False}
    messages = [body]
    disconnect = asyncio.Event()

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        raise AssertionError(message)

    scope = _messages_scope()
    task = asyncio.create_task(
        VariantMiddleware(django_like, canaries=CANARIES)(scope, receive, send)
    )
    await asyncio.wait_for(started.wait(), 5)
    await asyncio.sleep(0.3)  # past WATCH_AFTER_SECS: the watch reads `receive`
    disconnect.set()
    await asyncio.wait_for(task, 5)
    assert view_ended == ["cancelled"]
    ctx = context_of(scope)
    assert ctx is not None
    assert ctx.disconnected


def test_running_loop_is_the_running_loop_across_loops_and_threads() -> None:
    from switchyard_mw.asgi._disconnect import running_loop

    async def check() -> asyncio.AbstractEventLoop:
        loop = running_loop()
        assert loop is asyncio.get_running_loop()
        assert running_loop() is loop  # the cached answer
        return loop

    first = asyncio.run(check())
    second = asyncio.run(check())  # a new loop in the same thread: not the stopped one
    assert first is not second
    seen: list[asyncio.AbstractEventLoop] = []

    def in_thread() -> None:
        async def both() -> None:
            seen.append(await check())
            await asyncio.sleep(0)
            seen.append(await check())

        asyncio.run(both())

    threads = [threading.Thread(target=in_thread) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(seen) == 6
    assert len({id(loop) for loop in seen}) == 3  # each thread saw its own loop, twice


async def test_a_finished_request_leaves_nothing_behind_in_the_sweeper() -> None:
    """Its watch and its alarm leave the sweeper as it ends: no request state outlives it
    there (a queue once kept about 0.1 s of every request's state alive under load)."""
    import gc

    from switchyard_mw.asgi._disconnect import _Sweeper, running_loop
    from switchyard_mw.asgi.deadline import DeadlineMiddleware

    async def quick_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    def alive() -> int:
        gc.collect()
        return sum(isinstance(o, RequestContext) for o in gc.get_objects())

    mw = DeadlineMiddleware(quick_app, timeout_secs=60)  # long enough to defer its alarm
    before = alive()
    for _ in range(20):
        scope = _messages_scope()
        body = {"type": "http.request", "body": b'{"model": "m", "messages": []}'}
        await mw(scope, _replaying(body), _discard)
        ctx = context_of(scope)
        assert ctx is not None
        assert ctx.attempt_deadline_secs == 60
        del scope, ctx
    sweeper = _Sweeper.of(running_loop())
    assert not any(sweeper.ticks)
    assert alive() == before


async def test_deferred_work_of_a_request_that_outlasts_the_wait_starts() -> None:
    from switchyard_mw.asgi._disconnect import WATCH_AFTER_SECS, Deferred, defer, running_loop

    class Work(Deferred):
        __slots__ = ("started",)

        def start(self) -> None:
            self.started = asyncio.get_running_loop().time()

    loop = running_loop()
    kept, left = Work(), Work()
    begun = loop.time()
    defer(kept, loop)
    defer(left, loop)
    left.leave()
    await asyncio.sleep(WATCH_AFTER_SECS * 2)
    assert not kept.waiting
    assert WATCH_AFTER_SECS * 0.9 <= kept.started - begun <= WATCH_AFTER_SECS * 2
    assert not hasattr(left, "started")


@pytest.mark.parametrize("bound", [0.05, 0.3])  # a timer at once, and one the sweeper sets
@pytest.mark.parametrize(
    ("first", "anthropic"),
    [
        ({"type": "http.request", "body": b'{"model": "m", ', "more_body": True}, True),
        (None, False),  # not even the first chunk arrives
    ],
)
async def test_a_body_that_stops_arriving_is_a_408_within_the_bound(
    bound: float, first: dict[str, Any] | None, anthropic: bool
) -> None:
    app_called = False

    async def app_(scope: dict[str, Any], receive: Any, send: Any) -> None:
        nonlocal app_called
        app_called = True

    never = asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal first
        if first is not None:
            message, first = first, None
            return message
        await never.wait()  # the client sends nothing more and stays connected
        return {"type": "http.disconnect"}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = _messages_scope()
    if not anthropic:
        scope["path"] = "/v1/chat/completions"
    mw = VariantMiddleware(app_, canaries=CANARIES, server=Server(body_read_timeout_secs=bound))
    loop = asyncio.get_running_loop()
    started = loop.time()
    await asyncio.wait_for(mw(scope, receive, send), 10)
    assert loop.time() - started >= bound
    assert not app_called
    assert sent[0]["status"] == 408
    assert (b"connection", b"close") in sent[0]["headers"]
    error = json.loads(sent[1]["body"])["error"]
    assert error["type"] == "request_timeout"
    assert ("code" in error) is not anthropic
    # Nothing of the request is left waiting to fire later.
    assert asyncio.current_task() is not None
    assert not asyncio.current_task().cancelling()  # type: ignore[union-attr]


async def test_a_body_arriving_slowly_but_within_the_bound_is_read_whole() -> None:
    chunks = [b'{"model": "base", ', b'"messages": [{"role": "user", ', b'"content": "hi"}]}']
    received: list[bytes] = []

    async def app_(scope: dict[str, Any], receive: Any, send: Any) -> None:
        received.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(0.05)
        chunk = chunks.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    mw = VariantMiddleware(app_, canaries=CANARIES, server=Server(body_read_timeout_secs=1.0))
    await asyncio.wait_for(mw(_messages_scope(), receive, send), 10)
    assert sent[0]["status"] == 200
    assert json.loads(received[0])["messages"][0]["content"] == "hi"


async def test_twenty_stalled_bodies_at_once_each_get_their_408() -> None:
    """The sweeper sets each read's timer (a bound over twice its wait): all fire, every time."""
    never = asyncio.Event()

    async def app_(scope: dict[str, Any], receive: Any, send: Any) -> None:
        raise AssertionError("the app must not run for a body that never arrived")

    async def stalled(sent: list[dict[str, Any]]) -> None:
        first: dict[str, Any] | None = {"type": "http.request", "body": b"{", "more_body": True}

        async def receive() -> dict[str, Any]:
            nonlocal first
            if first is not None:
                message, first = first, None
                return message
            await never.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await mw(_messages_scope(), receive, send)

    mw = VariantMiddleware(app_, canaries=CANARIES, server=Server(body_read_timeout_secs=0.25))
    answers: list[list[dict[str, Any]]] = [[] for _ in range(20)]
    await asyncio.wait_for(asyncio.gather(*(stalled(sent) for sent in answers)), 10)
    assert [sent[0]["status"] for sent in answers] == [408] * 20
