"""A pass-through LLM gateway app: the example's forwarding half, reusable by a team's own app.

It forwards `/v1/messages`, `/v1/chat/completions` and `/v1/responses` to the account the
stack chose (`ctx.client`), with the body the stack rewrote, the account's key in place of the
caller's, and the request's deadline on the outbound call. Streams pass through chunk by chunk;
an upstream that dies mid-stream ends the stream with the wire's error event.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from .context import RequestContext, current_context
from .outbound import timeout_for
from .wire import Wire, error_body, stream_error_event

WIRE_ROUTES = ("/v1/messages", "/v1/chat/completions", "/v1/responses")

# Never forwarded: the caller's credentials (the account's replace them), what the transport
# recomputes, and hop-by-hop headers.
_DROP_REQUEST = frozenset(
    {
        "authorization",
        "x-api-key",
        "host",
        "content-length",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "upgrade",
        "proxy-authorization",
        "accept-encoding",
        "x-switchyard-cluster",
        "x-switchyard-timeout-ms",
        "x-envoy-expected-rq-timeout-ms",
    }
)
_DROP_RESPONSE = frozenset(
    {"content-length", "connection", "keep-alive", "transfer-encoding", "content-encoding"}
)


class Forwarder:
    """The endpoint that proxies one wire request; share one per process (one httpx pool)."""

    def __init__(self, http_client: httpx.AsyncClient) -> None:
        self.http = http_client

    async def forward(self, request: Request) -> Response:
        """A Starlette endpoint: `Route(path, forwarder.forward, methods=["POST"])`."""
        ctx = current_context()
        if ctx is None or ctx.client is None or ctx.view is None:
            return _error(Wire.OPENAI_CHAT, 500, "gateway_misconfigured", "no switchyard stack")
        client = ctx.client
        headers = [(k, v) for k, v in request.headers.items() if k not in _DROP_REQUEST]
        headers.extend(client.auth_headers())
        headers.append(("accept-encoding", "identity"))
        upstream = self.http.build_request(
            "POST",
            client.url(request.url.path),
            params=request.query_params,
            headers=headers,
            content=await request.body(),
            timeout=timeout_for(ctx),
        )
        response = await self.http.send(upstream, stream=True)
        out_headers = {k: v for k, v in response.headers.items() if k not in _DROP_RESPONSE}
        is_sse = response.headers.get("content-type", "").startswith("text/event-stream")
        if is_sse and response.status_code < 400:
            return StreamingResponse(
                _relay(response, ctx),
                status_code=response.status_code,
                headers=out_headers,
                background=BackgroundTask(response.aclose),
            )
        try:
            body = await response.aread()
        finally:
            await response.aclose()
        return Response(body, status_code=response.status_code, headers=out_headers)


async def _relay(response: httpx.Response, ctx: RequestContext) -> AsyncIterator[bytes]:
    try:
        async for chunk in response.aiter_raw():
            yield chunk
    except httpx.HTTPError as exc:
        # The client already has a 200: end its stream with the wire's error event, and let
        # the cooling policy count the account's fault all the same.
        ctx.report_upstream(502)
        wire = ctx.wire or Wire.OPENAI_CHAT
        message = f"upstream stream failed: {type(exc).__name__}"
        yield stream_error_event(wire, "upstream_error", message)


def _error(wire: Wire, status: int, error_type: str, message: str) -> Response:
    return Response(
        error_body(wire, error_type, message), status_code=status, media_type="application/json"
    )
