"""Small user gateways on Starlette, FastAPI, Litestar and Django, as a team would write them.

Each forwards `/v1/messages` and `/v1/chat/completions` with `make_http_client()`,
`current_context()`, `timeout_for(ctx)` and, for a stream, `relay_stream(answer)` in the
framework's own streaming response (README, "Wrap your own app"): to the account
switchyard chose, or, when no cooling policy chose one (a middleware used alone), to the app's
own default upstream. Each also has what a real app has beside its LLM routes: a lifespan, a
websocket echo at `/ws`, `GET /hello` and `POST /echo`.

`build(framework, mode, ...)` returns the ASGI app to serve: `mode` "stack" wraps it with
`switchyard_stack`; "cooling", "judge", "variant" and "deadline" add that middleware alone in
the framework's own way (`add_middleware`, Litestar's middleware list, Django's ASGI
application wrapped).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import fastapi
import httpx
import litestar
from litestar.middleware import DefineMiddleware
from litestar.response import Stream
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from switchyard_mw import (
    CoolingMiddleware,
    DeadlineMiddleware,
    JudgeMiddleware,
    VariantMiddleware,
    current_context,
    make_http_client,
    relay_stream,
    switchyard_stack,
    timeout_for,
)

FRAMEWORKS = ("starlette", "fastapi", "litestar", "django")
MODES = ("stack", "cooling", "judge", "variant", "deadline")
LLM_PATHS = ("/v1/messages", "/v1/chat/completions")
SYNC_VIEW_PATH = "/v1/responses"
"""Django only: served by a sync view (`_django_llm_sync`)."""
SYNC_VIEW_TIMEOUT_SECS = 30.0
DEFAULT_KEY = "app-default-key"
"""The key the app sends to its default upstream (no account chosen): the mock scripts it."""
DEADLINE_ALONE = {"timeout_secs": 1.0, "stream_idle_secs": 4.0}

LitestarRequest = litestar.Request[Any, Any, Any]
LitestarWebSocket = litestar.WebSocket[Any, Any, Any]


class Upstream:
    """The app's outbound half: one pooled client per app, closed at lifespan shutdown."""

    def __init__(self, default_url: str) -> None:
        self.default_url = default_url
        self.http = make_http_client()

    async def call(self, path: str, body: bytes) -> httpx.Response:
        """POST `body` to the chosen account (or the default upstream); headers read, not body."""
        ctx = current_context()
        if ctx is not None and ctx.account is not None:
            url, auth = ctx.account.url(path), dict(ctx.account.auth_headers())
        else:
            url, auth = self.default_url + path, {"x-api-key": DEFAULT_KEY}
        request = self.http.build_request(
            "POST",
            url,
            content=body,
            headers={"content-type": "application/json", **auth},
            timeout=timeout_for(ctx),
        )
        return await self.http.send(request, stream=True)


def streams(response: httpx.Response) -> bool:
    return response.headers.get("content-type", "").startswith("text/event-stream")


async def read_whole(response: httpx.Response) -> bytes:
    try:
        return await response.aread()
    finally:
        await response.aclose()


def media_type(response: httpx.Response) -> str:
    return response.headers.get("content-type", "application/json")


async def echo_websocket(scope: Any, receive: Any, send: Any) -> None:
    """A plain ASGI websocket echo (what a Django project mounts beside Django, or Channels)."""
    await receive()  # websocket.connect
    await send({"type": "websocket.accept"})
    message = await receive()
    await send({"type": "websocket.send", "text": "echo:" + (message.get("text") or "")})
    await send({"type": "websocket.close", "code": 1000})


# --- Starlette and FastAPI ---------------------------------------------------------------


def starlette_app(upstream: Upstream, events: list[str]) -> Any:
    async def llm(request: Request) -> Response:
        response = await upstream.call(request.url.path, await request.body())
        if streams(response):
            return StreamingResponse(
                relay_stream(response),
                status_code=response.status_code,
                media_type=media_type(response),
            )
        data = await read_whole(response)
        return Response(data, status_code=response.status_code, media_type=media_type(response))

    async def hello(_: Request) -> Response:
        return PlainTextResponse("hello from starlette")

    async def echo(request: Request) -> Response:
        return Response(await request.body(), media_type="application/json")

    async def ws(socket: WebSocket) -> None:
        await socket.accept()
        await socket.send_text("echo:" + await socket.receive_text())
        await socket.close()

    return Starlette(
        routes=[
            *(Route(path, llm, methods=["POST"]) for path in LLM_PATHS),
            Route("/hello", hello),
            Route("/echo", echo, methods=["POST"]),
            WebSocketRoute("/ws", ws),
        ],
        lifespan=_lifespan(upstream, events),
    )


def fastapi_app(upstream: Upstream, events: list[str]) -> Any:
    app = fastapi.FastAPI(lifespan=_lifespan(upstream, events))

    async def llm(request: fastapi.Request) -> Response:
        response = await upstream.call(request.url.path, await request.body())
        if streams(response):
            return StreamingResponse(
                relay_stream(response),
                status_code=response.status_code,
                media_type=media_type(response),
            )
        data = await read_whole(response)
        return Response(data, status_code=response.status_code, media_type=media_type(response))

    for path in LLM_PATHS:
        app.add_api_route(path, llm, methods=["POST"])

    @app.get("/hello", response_class=PlainTextResponse)
    async def hello() -> str:
        return "hello from fastapi"

    @app.post("/echo")
    async def echo(request: fastapi.Request) -> Response:
        return Response(await request.body(), media_type="application/json")

    @app.websocket("/ws")
    async def ws(socket: fastapi.WebSocket) -> None:
        await socket.accept()
        await socket.send_text("echo:" + await socket.receive_text())
        await socket.close()

    return app


def _lifespan(upstream: Upstream, events: list[str]) -> Callable[[Any], Any]:
    @contextlib.asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        events.append("startup")
        yield
        await upstream.http.aclose()
        events.append("shutdown")

    return lifespan


# --- Litestar ----------------------------------------------------------------------------


def litestar_app(upstream: Upstream, events: list[str], middleware: list[Any]) -> Any:
    @litestar.post(list(LLM_PATHS), status_code=200)
    async def llm(request: LitestarRequest) -> litestar.Response[Any]:
        response = await upstream.call(request.url.path, await request.body())
        if streams(response):
            return Stream(
                relay_stream(response),
                status_code=response.status_code,
                media_type=media_type(response),
            )
        data = await read_whole(response)
        return litestar.Response(
            data, status_code=response.status_code, media_type=media_type(response)
        )

    @litestar.get("/hello", media_type="text/plain")
    async def hello() -> str:
        return "hello from litestar"

    @litestar.post("/echo", status_code=200)
    async def echo(request: LitestarRequest) -> litestar.Response[bytes]:
        return litestar.Response(await request.body(), media_type="application/json")

    @litestar.websocket("/ws")
    async def ws(socket: LitestarWebSocket) -> None:
        await socket.accept()
        await socket.send_text("echo:" + await socket.receive_text())
        await socket.close()

    async def startup() -> None:
        events.append("startup")

    async def shutdown() -> None:
        await upstream.http.aclose()
        events.append("shutdown")

    return litestar.Litestar(
        route_handlers=[llm, hello, echo, ws],
        on_startup=[startup],
        on_shutdown=[shutdown],
        middleware=middleware,
    )


# --- Django ------------------------------------------------------------------------------

_django_upstream: list[Upstream] = []  # the view's upstream: Django's URLconf is per process


def _django_setup() -> None:
    import django
    from django.conf import settings

    if not settings.configured:
        settings.configure(
            DEBUG=False,
            ALLOWED_HOSTS=["*"],
            ROOT_URLCONF=__name__,
            SECRET_KEY="framework-matrix",  # a test app's, never a secret
            MIDDLEWARE=[],
            INSTALLED_APPS=[],
        )
        django.setup()


async def _django_llm(request: Any) -> Any:
    from django.http import HttpResponse, StreamingHttpResponse

    response = await _django_upstream[-1].call(request.path, request.body)
    if streams(response):
        return StreamingHttpResponse(
            relay_stream(response), status=response.status_code, content_type=media_type(response)
        )
    data = await read_whole(response)
    return HttpResponse(data, status=response.status_code, content_type=media_type(response))


def _django_llm_sync(request: Any) -> Any:
    """A sync view, as many Django projects write them (here for the Responses path): Django
    runs it in a thread, with a blocking client and a long timeout of its own (not
    `timeout_for`): nothing can stop its call before the upstream answers."""
    from django.http import HttpResponse

    upstream = _django_upstream[-1]
    ctx = current_context()
    if ctx is not None and ctx.account is not None:
        url, auth = ctx.account.url(request.path), dict(ctx.account.auth_headers())
    else:
        url, auth = upstream.default_url + request.path, {"x-api-key": DEFAULT_KEY}
    headers = {"content-type": "application/json", **auth}
    with httpx.Client(timeout=SYNC_VIEW_TIMEOUT_SECS) as client:
        response = client.post(url, content=request.body, headers=headers)
    return HttpResponse(
        response.content, status=response.status_code, content_type=media_type(response)
    )


async def _django_hello(_: Any) -> Any:
    from django.http import HttpResponse

    return HttpResponse(b"hello from django", content_type="text/plain")


async def _django_echo(request: Any) -> Any:
    from django.http import HttpResponse

    return HttpResponse(request.body, content_type="application/json")


def __getattr__(name: str) -> Any:
    # Django reads `urlpatterns` from ROOT_URLCONF (this module), after its setup.
    if name == "urlpatterns":
        from django.urls import path
        from django.views.decorators.csrf import csrf_exempt

        return [
            *(path(p.lstrip("/"), csrf_exempt(_django_llm)) for p in LLM_PATHS),
            path(SYNC_VIEW_PATH.lstrip("/"), csrf_exempt(_django_llm_sync)),
            path("hello", _django_hello),
            path("echo", csrf_exempt(_django_echo)),
        ]
    raise AttributeError(name)


def django_app(upstream: Upstream, events: list[str]) -> Any:
    """Django's ASGI application, with the lifespan and websockets a project routes beside it
    (Django serves neither)."""
    _django_setup()
    from django.core.asgi import get_asgi_application

    _django_upstream.append(upstream)
    django_asgi = get_asgi_application()

    async def project(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    events.append("startup")
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await upstream.http.aclose()
                    events.append("shutdown")
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        elif scope["type"] == "websocket":
            await echo_websocket(scope, receive, send)
        else:
            await django_asgi(scope, receive, send)

    return project


# --- the app each test serves ------------------------------------------------------------

_ALONE: Mapping[str, Callable[[Path], tuple[type[Any], dict[str, Any]]]] = {
    "cooling": lambda config: (CoolingMiddleware, {"config": config}),
    "judge": lambda config: (JudgeMiddleware, {"config": config}),
    "variant": lambda config: (VariantMiddleware, {"config": config}),
    "deadline": lambda config: (DeadlineMiddleware, dict(DEADLINE_ALONE)),
}


def build(
    framework: str, mode: str, *, config: Path, default_upstream: str, events: list[str]
) -> Any:
    """The ASGI app to serve: `framework`'s gateway with switchyard added as `mode` says."""
    upstream = Upstream(default_upstream)
    alone = _ALONE[mode](config) if mode != "stack" else None
    if framework == "litestar":
        middleware = []
        if alone is not None:
            options = alone[1]
            if mode == "judge":
                # Litestar's middleware never sees the lifespan, so the judge cannot close a
                # pool of its own: it shares the app's, which the app closes at shutdown.
                options = {**options, "http_client": upstream.http}
            middleware = [DefineMiddleware(alone[0], **options)]
        app = litestar_app(upstream, events, middleware)
    elif framework == "django":
        app = django_app(upstream, events)
        if alone is not None:
            app = alone[0](app, **alone[1])  # Django's way: wrap its ASGI application
    else:
        app = (starlette_app if framework == "starlette" else fastapi_app)(upstream, events)
        if alone is not None:
            app.add_middleware(alone[0], **alone[1])
    return switchyard_stack(app, config=config) if mode == "stack" else app
