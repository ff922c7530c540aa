"""Your own LLM gateway wrapped by switchyard: a complete Starlette app to copy and adapt.

    switchyard-mw mock --port 9100 &      # a stand-in provider (the config's accounts use it)
    MOCK_KEY_A=key-a MOCK_KEY_B=key-b MOCK_JUDGE_KEY=key-j \\
        uvicorn examples.wrap_your_app:app --port 8001

What is yours: `forward()`, an endpoint that calls the upstream and relays its answer, a
stream included (`relay_stream`), and the app around it. What switchyard adds, from one call
(`switchyard_stack`): before `forward()` runs, the request's model is decided (judge route,
canary) and written into the body, an account is chosen (`ctx.account`) and the attempt's
deadline is set (`timeout_for(ctx)`); an account that refuses or fails is failed over and
cooled, a deadline that runs out is answered 504 (or ends the stream with an error event), and
an upstream that breaks mid-stream ends the client's stream with the wire's error event.
FastAPI works the same: `app = switchyard_stack(FastAPI(...), config=...)`.

Environment: SWITCHYARD_CONFIG (default: examples/switchyard.toml, whose accounts point at
the mock on 127.0.0.1:9100 and read their keys from MOCK_KEY_A, MOCK_KEY_B, MOCK_JUDGE_KEY).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from switchyard_mw import (
    current_context,
    make_http_client,
    relay_stream,
    switchyard_stack,
    timeout_for,
)
from switchyard_mw.asgi.admin import OperatorOnly, cooling_status_app
from switchyard_mw.telemetry import otel
from switchyard_mw.telemetry.prometheus import metrics_app

CONFIG = os.environ.get("SWITCHYARD_CONFIG", str(Path(__file__).with_name("switchyard.toml")))
# Request headers the providers read besides the body; the caller's key is never passed on.
PASSED_ON = ("anthropic-version", "anthropic-beta", "openai-beta")

# One pooled client for every upstream call; it has no timeout of its own (timeout_for gives
# each call what is left of its deadline), and keeps no cookies between users.
http = make_http_client()


async def forward(request: Request) -> Response:
    """POST the body to the account switchyard chose and relay the answer as it comes."""
    ctx = current_context()  # the same object as request.state.switchyard
    if ctx is None or ctx.account is None:  # a model no account in the config serves
        return JSONResponse({"error": {"type": "not_found", "message": "unknown model"}}, 404)
    headers = {"content-type": "application/json", **dict(ctx.account.auth_headers())}
    headers |= {name: request.headers[name] for name in PASSED_ON if name in request.headers}
    upstream = http.build_request(
        "POST",
        ctx.account.url(request.url.path),  # the account's base_url + /v1/...
        content=await request.body(),  # `model` already set to the routed model
        headers=headers,
        timeout=timeout_for(ctx),  # a stream: each read bounded by stream_idle_secs
    )
    answer = await http.send(upstream, stream=True)
    content_type = answer.headers.get("content-type", "application/json")
    if content_type.startswith("text/event-stream"):
        # Whole events as they come; an upstream that breaks mid-stream ends the client's
        # stream with the wire's error event (the client already has its 200), never a cut
        # connection. The answer is closed however the stream ends.
        return StreamingResponse(
            relay_stream(answer), status_code=answer.status_code, media_type=content_type
        )
    try:
        body = await answer.aread()
    finally:
        await answer.aclose()
    # An account that knows the model by another name answers in it: the client gets the name
    # it asked for (relay_stream does the same for a stream). httpx hands the body decoded.
    namer = ctx.account.answer_namer(content_type) if answer.status_code < 300 else None
    if namer is not None:
        body = namer.feed(body) + namer.end()
    # The upstream's status, as it answered: switchyard reads it to tell a fault (401, 5xx)
    # from a success. An app that answers with another status calls ctx.report_upstream().
    return Response(body, status_code=answer.status_code, media_type=content_type)


async def hello(_: Request) -> Response:
    """A route of the app that is not an LLM call: switchyard passes it through untouched."""
    return JSONResponse({"hello": "world"})


@contextlib.asynccontextmanager
async def lifespan(_: Starlette) -> AsyncIterator[None]:
    yield
    await http.aclose()
    await app.aclose()  # the stack's judge client and state store


# Metrics: OpenTelemetry's standard set-up (Prometheus with the `prometheus` extra, OTLP when
# OTEL_EXPORTER_OTLP_ENDPOINT is set); a provider the app set up itself is kept.
otel.configure(service_name="my-llm-gateway")

my_app = Starlette(
    routes=[
        Route("/v1/messages", forward, methods=["POST"]),
        Route("/v1/chat/completions", forward, methods=["POST"]),
        Route("/v1/responses", forward, methods=["POST"]),
        Route("/hello", hello),
        # Operator routes, loopback clients only: Prometheus text, and each account's health.
        Route("/metrics", OperatorOnly(metrics_app), methods=["GET"]),
        Route(
            "/switchyard/accounts",
            OperatorOnly(cooling_status_app(lambda: app.pool)),  # the pool in force
            methods=["GET"],
        ),
    ],
    lifespan=lifespan,
)

app = switchyard_stack(my_app, config=CONFIG)
