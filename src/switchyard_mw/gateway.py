"""A pass-through LLM gateway app: the example's forwarding half, reusable by a team's own app.

It forwards `/v1/messages`, `/v1/chat/completions` and `/v1/responses` to the account the
stack chose (`ctx.client`), with the body the stack rewrote, the account's key in place of the
caller's, and the request's deadline on the outbound call. Streams pass through chunk by chunk;
an upstream that dies mid-stream ends the stream with the wire's error event.

With an OpenTelemetry SDK installed, each outbound call is a CLIENT span under the current
attempt's span, lasting until the upstream's body is read to its end (a stream included), and
the provider receives its `traceparent`; a non-streaming JSON answer's `usage` is reported to
the request's span (`ctx.report_usage`). Without an SDK none of that runs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import msgspec
from opentelemetry import propagate, trace
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from . import telemetry as tm
from .context import RequestContext, current_context
from .outbound import send_direct, timeout_for, transport_of
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
    {
        "content-length",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "content-encoding",
        "date",  # the gateway's own server sets these two; forwarded, they would appear twice
        "server",
    }
)


class Forwarder:
    """The endpoint that proxies one wire request; share one per process (one httpx pool)."""

    def __init__(self, http_client: httpx.AsyncClient) -> None:
        self.http = http_client
        # A client from `make_http_client()`: send straight to its transport (see there).
        self._transport = transport_of(http_client)

    async def forward(self, request: Request) -> Response:
        """A Starlette endpoint: `Route(path, forwarder.forward, methods=["POST"])`."""
        ctx = current_context()
        if ctx is None or ctx.client is None or ctx.view is None:
            return _error(Wire.OPENAI_CHAT, 500, "gateway_misconfigured", "no switchyard stack")
        client = ctx.client
        headers = [(k, v) for k, v in request.headers.items() if k not in _DROP_REQUEST]
        headers.extend(client.auth_headers())
        headers.append(("accept-encoding", "identity"))
        timeout = timeout_for(ctx)
        if self._transport is not None:
            upstream = httpx.Request(
                "POST",
                client.url(request.url.path),
                params=request.query_params or None,
                headers=headers,
                content=await request.body(),
            )
        else:
            upstream = self.http.build_request(
                "POST",
                client.url(request.url.path),
                params=request.query_params,
                headers=headers,
                content=await request.body(),
                timeout=timeout,
            )
        span = _start_call(upstream, client.base_url) if tm.tracing() else None
        try:
            with tm.activate(span or trace.INVALID_SPAN):
                if self._transport is not None:
                    response = await send_direct(self._transport, upstream, timeout)
                else:
                    response = await self.http.send(upstream, stream=True)
        except BaseException as exc:  # cancellation too: the span must end to be exported
            _end_call(span, exc)
            raise
        if span is not None:
            _answered(span, response.status_code)
        out_headers = {k: v for k, v in response.headers.items() if k not in _DROP_RESPONSE}
        content_type = response.headers.get("content-type", "")
        if content_type.startswith("text/event-stream") and response.status_code < 400:
            chunks = _relay(response, ctx)
            return StreamingResponse(
                chunks if span is None else _traced(chunks, span, ctx),
                status_code=response.status_code,
                headers=out_headers,
                background=BackgroundTask(response.aclose),
            )
        try:
            body = await response.aread()
        except BaseException as exc:
            _end_call(span, exc)
            raise
        finally:
            await response.aclose()
        if span is not None:
            span.end()
            if response.status_code < 300 and "json" in content_type:
                _report_usage(ctx, body)
        return Response(body, status_code=response.status_code, headers=out_headers)


async def _relay(response: httpx.Response, ctx: RequestContext) -> AsyncIterator[bytes]:
    """The upstream's stream, passed on one whole event at a time.

    A chunk may end inside an event; that tail waits for the rest, so that if the upstream
    dies there, the client's stream ends with a clean error event instead of half a frame
    glued to it.
    """
    pending = b""
    try:
        async for chunk in response.aiter_raw():
            data = pending + chunk if pending else chunk
            cut = _events_end(data)
            pending = data[cut:]
            if cut:
                yield data if cut == len(data) else data[:cut]
    except httpx.HTTPError as exc:
        # The client already has a 200: end its stream with the wire's error event, and let
        # the cooling policy count the account's fault all the same.
        ctx.report_upstream(502)
        wire = ctx.wire or Wire.OPENAI_CHAT
        message = f"upstream stream failed: {type(exc).__name__}"
        yield stream_error_event(wire, "upstream_error", message)
        return
    if pending:
        yield pending  # the upstream ended mid-event itself: pass on what it sent


def _events_end(data: bytes) -> int:
    """Length of the prefix of `data` that holds only whole SSE events."""
    end = data.rfind(b"\n\n")
    if end >= 0:
        return end + 2
    end = data.rfind(b"\r\n\r\n")
    return end + 4 if end >= 0 else 0


def _error(wire: Wire, status: int, error_type: str, message: str) -> Response:
    return Response(
        error_body(wire, error_type, message), status_code=status, media_type="application/json"
    )


# --- telemetry of the outbound call -----------------------------------------------------------


def _start_call(request: httpx.Request, base_url: str) -> trace.Span:
    """The CLIENT span of one outbound call (a child of the current attempt), propagated in
    the request's headers, where it replaces any `traceparent` the caller sent."""
    url = request.url
    attributes: dict[str, str | int] = {
        tm.HTTP_METHOD: request.method,
        tm.SERVER_ADDRESS: url.host,
        tm.SERVER_PORT: url.port or (443 if url.scheme == "https" else 80),
        # Neither query nor userinfo: either may carry a credential.
        tm.URL_FULL: f"{url.scheme}://{url.netloc.decode('ascii')}{url.path}",
    }
    if (provider := tm.provider_name(base_url)) is not None:
        attributes[tm.PROVIDER_NAME] = provider
    span = tm.tracer.start_span(tm.SPAN_OUTBOUND, kind=trace.SpanKind.CLIENT, attributes=attributes)
    # A sampled-out span is propagated too: the provider then keeps the same decision.
    propagate.inject(request.headers, context=trace.set_span_in_context(span))
    return span


def _answered(span: trace.Span, status: int) -> None:
    span.set_attribute(tm.HTTP_STATUS, status)
    if status >= 400:  # for a client span, every 4xx and 5xx is an error of the call
        span.set_attribute(tm.ERROR_TYPE, str(status))
        span.set_status(trace.StatusCode.ERROR)


def _end_call(span: trace.Span | None, exc: BaseException) -> None:
    """End a call's span on an exception, naming only its type (its text may quote data)."""
    if span is None:
        return
    span.set_attribute(tm.ERROR_TYPE, type(exc).__qualname__)
    span.set_status(trace.StatusCode.ERROR)
    span.end()


async def _traced(
    chunks: AsyncIterator[bytes], span: trace.Span, ctx: RequestContext
) -> AsyncIterator[bytes]:
    """The relayed stream, ending the call's span when it ends, however it ends.

    Not in the response's background task: a stream cut by its deadline or by the client
    never runs that, and a span never ended is never exported.
    """
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        if ctx.upstream_status is not None and ctx.upstream_status >= 500:
            # `_relay` reports a stream the upstream broke off as a 502 upstream status.
            span.set_attribute(tm.ERROR_TYPE, "stream_interrupted")
            span.set_status(trace.StatusCode.ERROR)
        span.end()


class _Usage(msgspec.Struct):
    input_tokens: int | None = None  # Anthropic Messages, OpenAI Responses
    output_tokens: int | None = None
    cache_read_input_tokens: int | None = None  # Anthropic counts cached input apart
    cache_creation_input_tokens: int | None = None
    prompt_tokens: int | None = None  # OpenAI Chat Completions
    completion_tokens: int | None = None


class _Reply(msgspec.Struct):
    usage: _Usage | None = None


_REPLY = msgspec.json.Decoder(_Reply)  # skips every other field of the answer unread


def _report_usage(ctx: RequestContext, body: bytes) -> None:
    """`ctx.report_usage` from a JSON answer's `usage`, in the GenAI conventions' terms:
    input tokens include cached ones."""
    try:
        usage = _REPLY.decode(body).usage
    except msgspec.DecodeError:
        return  # not a shape we know: report nothing rather than something wrong
    if usage is None:
        return
    if ctx.wire is Wire.OPENAI_CHAT or usage.input_tokens is None:
        ctx.report_usage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens)
        return
    inputs = usage.input_tokens
    if ctx.wire is Wire.ANTHROPIC:
        inputs += (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)
    ctx.report_usage(input_tokens=inputs, output_tokens=usage.output_tokens)
