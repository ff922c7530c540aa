"""An LLM gateway in front of Anthropic/OpenAI-style providers, wrapped by switchyard_stack().

    python examples/starlette_app.py            # serves 127.0.0.1:8000, mock provider on :9100
    SWITCHYARD_CONFIG=my.toml uvicorn examples.starlette_app:app --timeout-keep-alive 75
    SWITCHYARD_CONFIG=my.toml uvicorn examples.starlette_app:app --timeout-keep-alive 75 --workers 4
        # keep-alive above the clients' idle expiry (docs/operations.md, "Keep-alive")
        # with `[state] backend = "redis"` in my.toml (the redis extra: pip install '.[redis]'), the
        # workers share account cooling; /switchyard/accounts shows it from whichever answers

Environment:
    SWITCHYARD_CONFIG      the config file (default: examples/switchyard.toml, on the mock)
    SWITCHYARD_START_MOCK  1 to start the bundled mock provider in this process (default: 1
                           with the default config, else 0); SWITCHYARD_MOCK_PORT (9100)
                           moves it (and the default config's accounts with it)
    SWITCHYARD_OPERATOR_ALLOW  client addresses (comma-separated) that may call the operator
                           routes besides loopback: /metrics, /switchyard/* (default: none)
    HOST, PORT, LOG_LEVEL  where `python examples/starlette_app.py` serves (127.0.0.1, 8000)
    OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_SERVICE_NAME, ...   the standard OpenTelemetry variables:
                           with an endpoint, traces and metrics also go out over OTLP
                           (`switchyard_mw.telemetry.otel.configure`); metrics are always on
                           /metrics

Reloading the config (docs/operations.md): `kill -HUP <pid>` of each process serving it (each
uvicorn worker; `/switchyard/health` names the pid that answered), or `POST /switchyard/reload`
from loopback, which reloads the worker that takes the request.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, request_response

from switchyard_mw.asgi.admin import CanariesStatusApp, HealthApp, OperatorOnly, ReloadApp
from switchyard_mw.asgi.cooling import cooling_status_app
from switchyard_mw.asgi.stack import switchyard_stack
from switchyard_mw.config import Config, load_config, parse_config
from switchyard_mw.engine.outbound import make_http_client
from switchyard_mw.gateway import WIRE_ROUTES, Forwarder
from switchyard_mw.telemetry import otel, prometheus

DEFAULT_CONFIG = Path(__file__).with_name("switchyard.toml")
CONFIG = os.environ.get("SWITCHYARD_CONFIG", str(DEFAULT_CONFIG))
USING_DEFAULT = str(DEFAULT_CONFIG) == CONFIG
START_MOCK = os.environ.get("SWITCHYARD_START_MOCK", "1" if USING_DEFAULT else "0")


def _start_mock_provider() -> None:
    """The bundled mock, on its own thread and event loop, so the example runs offline."""
    import uvicorn

    from switchyard_mw.testing import Behaviour, MockProvider

    port = int(os.environ.get("SWITCHYARD_MOCK_PORT", "9100"))
    mock = MockProvider()
    # The judge of the `auto` route is the mock too: have it answer with one of the labels.
    mock.set_behaviour(os.environ["MOCK_JUDGE_KEY"], Behaviour(reply="complex"))
    server = uvicorn.Server(uvicorn.Config(mock, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, name="mock-provider", daemon=True).start()


def _config() -> Config:
    """The config (read again at each reload); the default one pointed at wherever the
    bundled mock runs."""
    if not USING_DEFAULT:
        return load_config(CONFIG)
    port = os.environ.get("SWITCHYARD_MOCK_PORT", "9100")
    text = DEFAULT_CONFIG.read_text().replace("127.0.0.1:9100", f"127.0.0.1:{port}")
    return parse_config(text, source=CONFIG)


if START_MOCK == "1":
    # The mock accepts any key; the default config names these variables.
    os.environ.setdefault("MOCK_KEY_A", "mock-key-a")
    os.environ.setdefault("MOCK_KEY_B", "mock-key-b")
    os.environ.setdefault("MOCK_JUDGE_KEY", "mock-judge-key")
    _start_mock_provider()

otel.configure(service_name="switchyard-gateway")
http_client = make_http_client()
forwarder = Forwarder(http_client)


async def metrics(_: Request) -> Response:
    status, body, content_type = prometheus.render()
    return Response(body, status_code=status, media_type=content_type)


@contextlib.asynccontextmanager
async def lifespan(_: Starlette) -> AsyncIterator[None]:
    yield
    await http_client.aclose()
    await app.aclose()


gateway = Starlette(
    routes=[*(Route(path, forwarder, methods=["POST"]) for path in WIRE_ROUTES)],
    lifespan=lifespan,
)
app = switchyard_stack(gateway, config=_config(), reload_from=_config)
# Operator routes: loopback only unless SWITCHYARD_OPERATOR_ALLOW names more (SECURITY.md).
# Each view asks the stack for what is in force now, so it follows reloads.
allow = [a.strip() for a in os.environ.get("SWITCHYARD_OPERATOR_ALLOW", "").split(",") if a.strip()]
operator_routes = {
    "/metrics": (request_response(metrics), ["GET"]),
    "/switchyard/accounts": (cooling_status_app(lambda: app.pool), ["GET", "HEAD"]),
    "/switchyard/health": (HealthApp(config=lambda: app.config), ["GET"]),
    "/switchyard/canaries": (CanariesStatusApp(lambda: app.variant.canaries), ["GET"]),
    "/switchyard/reload": (ReloadApp(app.reload), ["POST"]),
}
for path, (view, methods) in operator_routes.items():
    gateway.add_route(path, OperatorOnly(view, allow=allow), methods=methods)

if __name__ == "__main__":
    import uvicorn

    uvicorn.run(
        app,
        # Longer than clients keep an idle connection (httpx, under the OpenAI and Anthropic
        # SDKs: 5 s, uvicorn's own default): else a request sent as uvicorn closes an idle
        # connection is reset. docs/operations.md, "Keep-alive".
        timeout_keep_alive=75,
        host=os.environ.get("HOST", "127.0.0.1"),
        port=int(os.environ.get("PORT", "8000")),
        log_level=os.environ.get("LOG_LEVEL", "info"),
    )
