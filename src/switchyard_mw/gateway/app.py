"""The whole forwarding gateway as one ASGI app: the three LLM wires (and Anthropic's token
counting) forwarded through the stack, the models list and the wire's 404 for any other `/v1/`
path (`gateway_routes`), `/metrics`, and the operator routes (loopback only unless `allow`
names more).

`switchyard-mw serve` serves it (`gateway_from_env`, a uvicorn factory); the example
(`examples/starlette_app.py`) builds the same app beside its in-process mock.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Callable, Sequence

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, request_response
from starlette.types import ASGIApp

from ..asgi.admin import (
    CanariesStatusApp,
    HealthApp,
    OperatorOnly,
    ReloadApp,
    TenantsStatusApp,
)
from ..asgi.cooling import cooling_status_app
from ..asgi.stack import SwitchyardStack, switchyard_stack
from ..clients.outbound import make_http_client
from ..config import Config, load_config
from ..engine.early_signal import hold_early
from ..telemetry import otel, prometheus
from .forwarder import Forwarder
from .routes import gateway_routes

CONFIG_ENV = "SWITCHYARD_CONFIG"
"""The config file `gateway_from_env` serves (the serve command sets it for its workers)."""
ALLOW_ENV = "SWITCHYARD_OPERATOR_ALLOW"
"""Client addresses (comma-separated) that may call the operator routes besides loopback."""

OPERATOR_ROUTES: dict[str, tuple[str, ...]] = {
    "/metrics": ("GET",),
    "/switchyard/accounts": ("GET", "HEAD"),
    "/switchyard/health": ("GET",),
    "/switchyard/canaries": ("GET",),
    "/switchyard/tenants": ("GET",),
    "/switchyard/reload": ("POST",),
}
"""The operator routes and their methods."""


async def _metrics(_: Request) -> Response:
    status, body, content_type = prometheus.render()
    return Response(body, status_code=status, media_type=content_type)


def gateway_app(
    config: Config,
    *,
    reload_from: Callable[[], Config] | str,
    allow: Sequence[str] = (),
) -> SwitchyardStack:
    """The forwarding gateway on `config`; `reload_from` is what a reload (SIGHUP,
    `POST /switchyard/reload`) reads. Telemetry is configured as the environment says."""
    otel.configure(service_name="switchyard-gateway")
    http_client = make_http_client()

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        yield
        await http_client.aclose()
        await app.aclose()

    gateway = Starlette(lifespan=lifespan)
    app = switchyard_stack(gateway, config=config, reload_from=reload_from)
    # The LLM calls (forwarded), then /v1/models from the config in force and the wire's 404
    # for any other /v1/ path (added once the stack exists: the models list follows it).
    gateway.router.routes.extend(gateway_routes(Forwarder(http_client), lambda: app.config))
    # Each view asks the stack for what is in force now, so it follows reloads.
    views: dict[str, ASGIApp] = {
        "/metrics": request_response(_metrics),
        "/switchyard/accounts": cooling_status_app(lambda: app.pool),
        "/switchyard/health": HealthApp(config=lambda: app.config),
        "/switchyard/canaries": CanariesStatusApp(lambda: app.variant.canaries),
        "/switchyard/tenants": TenantsStatusApp(lambda: app.tenancy),
        "/switchyard/reload": ReloadApp(app.reload),
    }
    for path, view in views.items():
        methods = list(OPERATOR_ROUTES[path])
        gateway.router.routes.append(Route(path, OperatorOnly(view, allow=allow), methods=methods))
    return app


def allowed_from_env() -> list[str]:
    """`SWITCHYARD_OPERATOR_ALLOW`, split."""
    return [a.strip() for a in os.environ.get(ALLOW_ENV, "").split(",") if a.strip()]


def gateway_from_env() -> SwitchyardStack:
    """The gateway on the config file `SWITCHYARD_CONFIG` names (a uvicorn factory: each
    worker of `switchyard-mw serve --workers N` builds its own)."""
    hold_early()  # a SIGHUP passed on while this worker starts must not end it
    path = os.environ[CONFIG_ENV]
    return gateway_app(load_config(path), reload_from=path, allow=allowed_from_env())
