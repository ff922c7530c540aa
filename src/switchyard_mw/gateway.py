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

import aiohttp
import httpx
import msgspec
from opentelemetry import propagate, trace
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from . import telemetry as tm
from .context import RequestContext, current_context
from .outbound import PooledTransport, as_httpx_error, pool_of, seconds_left, timeout_for
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


_DROP_RESPONSE_RAW = frozenset(name.encode() for name in _DROP_RESPONSE)


class Forwarder:
    """The endpoint that proxies one wire request; share one per process (one pool).

    With a client from `make_http_client()` it sends through that client's aiohttp pool
    directly (`pool_of`): for a call that only forwards bytes, httpx's request and response
    objects cost about half of the CPU. Any other httpx client is used through its own API.
    Either way the app sees httpx's exceptions.
    """

    def __init__(self, http_client: httpx.AsyncClient) -> None:
        self.http = http_client
        self._pool = pool_of(http_client)

    async def forward(self, request: Request) -> Response:
        """A Starlette endpoint: `Route(path, forwarder.forward, methods=["POST"])`."""
        ctx = current_context()
        if ctx is None or ctx.client is None or ctx.view is None:
            return _error(Wire.OPENAI_CHAT, 500, "gateway_misconfigured", "no switchyard stack")
        client = ctx.client
        headers = [(k, v) for k, v in request.headers.items() if k not in _DROP_REQUEST]
        headers.extend(client.auth_headers())
        headers.append(("accept-encoding", "identity"))
        url = client.url(request.url.path)
        query = request.scope.get("query_string", b"")
        if query:
            url = f"{url}?{query.decode('latin-1')}"
        body = await request.body()
        span = None
        if tm.tracing():
            span = _start_call(httpx.URL(url), client.base_url)
            headers = _propagated(headers, span)
        try:
            if self._pool is not None:
                reply = await _Reply.pooled(self._pool, url, headers, body, seconds_left(ctx))
            else:
                reply = await _Reply.httpx(self.http, url, headers, body, timeout_for(ctx))
        except BaseException as exc:  # cancellation too: the span must end to be exported
            _end_call(span, exc)
            raise
        if span is not None:
            _answered(span, reply.status)
        content_type = reply.content_type
        if content_type.startswith("text/event-stream") and reply.status < 400:
            chunks = _relay(reply, ctx)
            streaming = StreamingResponse(
                chunks if span is None else _traced(chunks, span, ctx),
                status_code=reply.status,
                background=BackgroundTask(reply.aclose),
            )
            return _with_headers(streaming, reply)
        try:
            data = await reply.read()
        except BaseException as exc:
            _end_call(span, exc)
            raise
        finally:
            await reply.aclose()
        if span is not None:
            span.end()
            if reply.status < 300 and "json" in content_type:
                _report_usage(ctx, data)
        return _with_headers(Response(data, status_code=reply.status), reply)


class _Reply:
    """An upstream answer from either client, raising httpx's exceptions while it is read."""

    __slots__ = ("_aiohttp", "_httpx", "content_type", "raw_headers", "status")

    def __init__(
        self,
        status: int,
        raw_headers: list[tuple[bytes, bytes]],
        *,
        aiohttp_response: aiohttp.ClientResponse | None = None,
        httpx_response: httpx.Response | None = None,
    ) -> None:
        self.status = status
        self.raw_headers = raw_headers
        self._aiohttp = aiohttp_response
        self._httpx = httpx_response
        self.content_type = next(
            (v.decode("latin-1") for k, v in raw_headers if k.lower() == b"content-type"), ""
        )

    @classmethod
    async def pooled(
        cls,
        pool: PooledTransport,
        url: str,
        headers: list[tuple[str, str]],
        body: bytes,
        secs: float,
    ) -> _Reply:
        # What `timeout_for` gives httpx, in aiohttp's terms: connecting, waiting for a pooled
        # connection and every read are each bounded by what is left of the deadline.
        limits = aiohttp.ClientTimeout(total=None, connect=secs, sock_connect=secs, sock_read=secs)
        try:
            response = await pool.session().request(
                "POST",
                url,
                headers=headers,
                data=body,
                allow_redirects=False,
                auto_decompress=False,
                timeout=limits,
            )
        except aiohttp.ClientError as exc:
            as_httpx_error(exc)
        return cls(response.status, list(response.raw_headers), aiohttp_response=response)

    @classmethod
    async def httpx(
        cls,
        http: httpx.AsyncClient,
        url: str,
        headers: list[tuple[str, str]],
        body: bytes,
        limits: httpx.Timeout,
    ) -> _Reply:
        upstream = http.build_request("POST", url, headers=headers, content=body, timeout=limits)
        response = await http.send(upstream, stream=True)
        return cls(response.status_code, response.headers.raw, httpx_response=response)

    async def chunks(self) -> AsyncIterator[bytes]:
        if self._httpx is not None:
            async for chunk in self._httpx.aiter_raw():
                yield chunk
            return
        assert self._aiohttp is not None
        try:
            async for chunk in self._aiohttp.content.iter_any():
                yield chunk
        except aiohttp.ClientError as exc:
            as_httpx_error(exc)

    async def read(self) -> bytes:
        if self._httpx is not None:
            return await self._httpx.aread()
        assert self._aiohttp is not None
        try:
            return await self._aiohttp.read()
        except aiohttp.ClientError as exc:
            as_httpx_error(exc)

    async def aclose(self) -> None:
        if self._httpx is not None:
            await self._httpx.aclose()
        elif self._aiohttp is not None:
            self._aiohttp.release()  # back to the pool when read whole; closed otherwise


def _with_headers(response: Response, reply: _Reply) -> Response:
    """`response` with the upstream's headers, duplicates kept, minus hop-by-hop ones."""
    response.raw_headers.extend(
        (name, value)
        for name, value in ((k.lower(), v) for k, v in reply.raw_headers)
        if name not in _DROP_RESPONSE_RAW
    )
    return response


async def _relay(reply: _Reply, ctx: RequestContext) -> AsyncIterator[bytes]:
    """The upstream's stream, passed on one whole event at a time.

    A chunk may end inside an event; that tail waits for the rest, so that if the upstream
    dies there, the client's stream ends with a clean error event instead of half a frame
    glued to it.
    """
    pending = b""
    try:
        async for chunk in reply.chunks():
            data = pending + chunk if pending else chunk
            cut = _events_end(data)
            pending = data[cut:]
            if cut:
                yield data if cut == len(data) else data[:cut]
    except httpx.HTTPError as exc:  # `_Reply` raises httpx's errors for either client
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


def _start_call(url: httpx.URL, base_url: str) -> trace.Span:
    """The CLIENT span of one outbound call (a child of the current attempt)."""
    attributes: dict[str, str | int] = {
        tm.HTTP_METHOD: "POST",
        tm.SERVER_ADDRESS: url.host,
        tm.SERVER_PORT: url.port or (443 if url.scheme == "https" else 80),
        # Neither query nor userinfo: either may carry a credential.
        tm.URL_FULL: f"{url.scheme}://{url.netloc.decode('ascii')}{url.path}",
    }
    if (provider := tm.provider_name(base_url)) is not None:
        attributes[tm.PROVIDER_NAME] = provider
    return tm.tracer.start_span(tm.SPAN_OUTBOUND, kind=trace.SpanKind.CLIENT, attributes=attributes)


def _propagated(headers: list[tuple[str, str]], span: trace.Span) -> list[tuple[str, str]]:
    """`headers` carrying `span`'s context, in place of any `traceparent` the caller sent.

    A sampled-out span is propagated too: the provider then keeps the same decision.
    """
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    names = {name.lower() for name in carrier}
    return [(k, v) for k, v in headers if k.lower() not in names] + list(carrier.items())


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


class _Answer(msgspec.Struct):
    usage: _Usage | None = None


_ANSWER = msgspec.json.Decoder(_Answer)  # skips every other field of the answer unread


def _report_usage(ctx: RequestContext, body: bytes) -> None:
    """`ctx.report_usage` from a JSON answer's `usage`, in the GenAI conventions' terms:
    input tokens include cached ones."""
    try:
        usage = _ANSWER.decode(body).usage
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
