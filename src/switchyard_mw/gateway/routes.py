"""The forwarding app's answers to what clients call besides the LLM calls (`/v1/models`,
`/v1/models/{id}`, a 404 in the wire's shape for any other `/v1/` path): the engine's
`Endpoints`, served as an ASGI app. Mount it last, on every method, at `OTHER_ROUTE`."""

from __future__ import annotations

from collections.abc import Callable

from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from ..config import Config
from ..engine.endpoints import Endpoints
from .forwarder import WIRE_ROUTES, Forwarder

OTHER_ROUTE = "/v1/{path:path}"
"""The route under which `OtherEndpoints` answers (after the wire routes, so they match first)."""
LOCAL_ROUTES = ["GET /v1/models", "GET /v1/models/{id}", "* /v1/... (404)"]
"""What `OtherEndpoints` answers itself, as the serve command's banner lists it."""
_VERSION = b"anthropic-version"
_JSON = (b"content-type", b"application/json")


class OtherEndpoints:
    """Answers `/v1/` requests no wire route took, from the config in force (`config()` is
    asked per request, so a reload changes the models list); built once per config."""

    def __init__(self, config: Callable[[], Config]) -> None:
        self._config = config
        self._endpoints: Endpoints | None = None

    def endpoints(self) -> Endpoints:
        """The answers of the config in force (built again only when a reload changed it)."""
        config = self._config()
        endpoints = self._endpoints
        if endpoints is None or endpoints.config is not config:
            endpoints = self._endpoints = Endpoints(config)
        return endpoints

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        root: str = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]
        versioned = any(name == _VERSION for name, _ in scope["headers"])
        method: str = scope["method"]
        query = scope.get("query_string", b"").decode("latin-1")
        answer = self.endpoints().answer(method, path, query, anthropic_version=versioned)
        length = (b"content-length", b"%d" % len(answer.body))
        start = {"type": "http.response.start", "status": answer.status, "headers": [_JSON, length]}
        await send(start)
        await send({"type": "http.response.body", "body": answer.body})


def gateway_routes(forwarder: Forwarder, config: Callable[[], Config]) -> list[Route]:
    """Every route a forwarding gateway serves under `/v1/`: `forwarder` on each of
    `WIRE_ROUTES` (POST), then `OtherEndpoints` for the rest (the models list, the 404s)."""
    routes = [Route(path, forwarder, methods=["POST"]) for path in WIRE_ROUTES]
    return [*routes, Route(OTHER_ROUTE, OtherEndpoints(config))]
