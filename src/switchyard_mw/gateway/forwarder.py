"""A pass-through LLM gateway app: the example's forwarding half, reusable by a team's own app.

It forwards `/v1/messages` (and its `count_tokens`), `/v1/chat/completions` and `/v1/responses`
to the account the stack chose (`ctx.account`), with the body the stack rewrote, the account's
key in place of the caller's, and the request's deadline on the outbound call. Streams pass
through chunk by chunk; an upstream that dies mid-stream ends the stream with the wire's error
event.

The usage of every successful JSON answer and of every stream it relays (all three wires) is
reported (`ctx.report_usage`), with or without an OpenTelemetry SDK: the request metrics and
the tenants' limits (`engine.tenancy`, which settles a reservation with it) count it.

With an OpenTelemetry SDK installed, each outbound call is a CLIENT span under the current
attempt's span, lasting until the upstream's body is read to its end (a stream included), and
the provider receives its `traceparent`. Without an SDK none of that runs.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncGenerator, AsyncIterator, Iterable

from ..errors import CloudCredentialError, MissingExtraError, WireError

try:
    import aiohttp

    from ..clients.aiohttp_pool import PooledTransport
except ImportError as exc:
    raise MissingExtraError("switchyard_mw.gateway", "gateway", exc) from None
import httpx
from opentelemetry import trace
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from ..accounts import Account
from ..answer_names import answer_with_model
from ..asgi.relay import relay_events
from ..clients.outbound import map_exceptions, pool_of, seconds_left, timeout_for
from ..clouds import StreamTranslator
from ..context import RequestContext, current_context
from ..engine.provider_headers import REQUEST_ID_NAMES, request_id, withheld
from ..engine.usage import answer_tokens, report_tokens
from ..model_names import with_query
from ..request_body import ClientDisconnected, read_body
from ..telemetry import names as tm
from ..wire import WIRE_PATHS, Wire, error_body, model_not_served
from . import telemetry as ot
from .upstream_body import upstream_body

WIRE_ROUTES = tuple(WIRE_PATHS)
"""The paths a gateway forwards: mount a `Forwarder` on each (POST). The three wires' and
Anthropic's token counting (`/v1/messages/count_tokens`), which fails over like any call."""

# Never forwarded: the caller's credentials (the account's replace them), what the transport
# recomputes, and hop-by-hop headers.
_DROP_REQUEST = frozenset(
    {
        "authorization",
        "x-api-key",
        "api-key",
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


_DROP_REQUEST_RAW = frozenset(name.encode() for name in _DROP_REQUEST)
_DROP_RESPONSE_RAW = frozenset(name.encode() for name in _DROP_RESPONSE)
_IDENTITY = ("accept-encoding", "identity")
_DROPPED, _WITHHELD, _REQUEST_ID = 1, 2, 4
_KINDS: dict[bytes, int] = {}
"""What an answer's header (lowercase name) is to the relay, flags of the three above (0: it
passes), by name as first seen: names repeat from answer to answer, so one lookup a header."""
_KINDS_MAX = 1024


def _kind(name: bytes) -> int:
    kind = _DROPPED if name in _DROP_RESPONSE_RAW else 0
    kind |= (_WITHHELD if withheld(name) else 0) | (_REQUEST_ID if name in REQUEST_ID_NAMES else 0)
    if len(_KINDS) < _KINDS_MAX:  # a peer may send any names: the table stays bounded
        _KINDS[name] = kind
    return kind


class Forwarder:
    """The endpoint that proxies one wire request; share one per process (one pool).

    Mount it as an ASGI endpoint, `Route(path, forwarder, methods=["POST"])`: it reads the
    scope and answers with ASGI messages itself, with no Starlette request or response built.
    `forward` is the same as a Starlette endpoint, for an app that calls it from its own.

    With a client from `make_http_client()` it sends through that client's aiohttp pool
    directly (`pool_of`): for a call that only forwards bytes, httpx's request and response
    objects cost about half of the CPU. Any other httpx client is used through its own API.
    Either way a failed call raises the `switchyard_mw.errors.TransportError` of its kind
    (`map_exceptions()`), which is also httpx's exception of that name.
    """

    def __init__(self, http_client: httpx.AsyncClient) -> None:
        self.http = http_client
        self._pool = pool_of(http_client)
        self._sends: dict[str, _Sends] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ctx = current_context()
        if ctx is None or ctx.account is None or ctx.view is None:
            await _unplaced(ctx)(scope, receive, send)
            return
        message = await receive()
        if message["type"] == "http.request" and not message.get("more_body", False):
            body = message.get("body", b"")  # the usual case: the stack replays it whole
        else:
            body = await _request_body(receive, message)
        reply = await self._call(ctx, ctx.account, scope, body)
        if isinstance(reply, Response):  # answered in the gateway: a cloud refused the request
            await reply(scope, receive, send)
            return
        if reply.streams:
            await _stream(reply, ctx, send)
            return
        data = await self._read(reply, ctx)
        headers = reply.headers  # after the read: a cloud's error may have changed them
        if reply.status >= 200 and reply.status not in (204, 304):
            headers = [(b"content-length", b"%d" % len(data)), *headers]  # as Starlette's
        await send({"type": "http.response.start", "status": reply.status, "headers": headers})
        await send({"type": "http.response.body", "body": data})

    async def forward(self, request: Request) -> Response:
        """A Starlette endpoint: `Route(path, forwarder.forward, methods=["POST"])`."""
        ctx = current_context()
        if ctx is None or ctx.account is None or ctx.view is None:
            return _unplaced(ctx)
        reply = await self._call(ctx, ctx.account, request.scope, await request.body())
        if isinstance(reply, Response):
            return reply
        if reply.streams:
            return self._streaming(reply, ctx)
        data = await self._read(reply, ctx)
        response = Response(data, status_code=reply.status)
        response.raw_headers.extend(reply.headers)
        return response

    async def _call(
        self, ctx: RequestContext, account: Account, scope: Scope, body: bytes
    ) -> _Reply | Response:
        """Send the request upstream; the reply's headers have arrived, its body not yet (or
        the answer of a cloud account that cannot take the request)."""
        ctx.upstream_request_id = None  # the last attempt's answer is not this one's
        sends = self._sends.get(account.name)
        if sends is None or sends.spec is not account.spec or sends.key != account.api_key:
            sends = self._sends[account.name] = _Sends(account)
        headers = [
            (name.decode("latin-1"), value.decode("latin-1"))
            for name, value in scope["headers"]
            if name not in _DROP_REQUEST_RAW
        ]
        headers += sends.headers
        # The path as Starlette's `request.url.path` gives it.
        path = scope["path"].replace("?", "%3F").replace("#", "%23").replace("\\", "%5C")
        query = scope.get("query_string", b"").decode("latin-1")
        if account.cloud is not None:
            prepared = await _cloud_request(ctx, account, path, headers, body)
            if isinstance(prepared, Response):
                return prepared
            url, headers, body = prepared
        else:
            url = with_query(account.url(path), query)  # the account's path template, if any
        span = None
        if tm.tracing():
            span = ot.start_call(httpx.URL(url), account.base_url)
            headers = ot.propagated(headers, span)
        try:
            if self._pool is not None:
                reply = await _Reply.pooled(self._pool, url, headers, body, _limits(ctx))
            else:
                reply = await _Reply.httpx(self.http, url, headers, body, timeout_for(ctx))
        except BaseException as exc:  # cancellation too: the span must end to be exported
            ot.end_call(span, exc)
            raise
        if span is not None:
            ot.answered(span, reply.status)
        reply.span = span
        ctx.upstream_request_id = reply.request_id
        if reply.status < 300:
            reply.public = account.answer_name
        if account.cloud is not None:
            reply.from_cloud(account)
        return reply

    @staticmethod
    def _streaming(reply: _Reply, ctx: RequestContext) -> StreamingResponse:
        chunks = _relay(reply, ctx)
        span = reply.span
        streaming = StreamingResponse(
            chunks if span is None else ot.traced(chunks, span, ctx),
            status_code=reply.status,
            background=BackgroundTask(reply.aclose),
        )
        streaming.raw_headers.extend(reply.headers)
        return streaming

    @staticmethod
    async def _read(reply: _Reply, ctx: RequestContext) -> bytes:
        span = reply.span
        try:
            data = await reply.read()
        except BaseException as exc:
            ot.end_call(span, exc)
            raise
        finally:
            await reply.aclose()
        if span is not None:
            span.end()
        if reply.cloud is not None and reply.status >= 400:
            data = reply.cloud_error(data)
        if reply.status < 300 and "json" in reply.content_type:
            report_tokens(ctx, answer_tokens(ctx.wire, data))  # request metrics, SDK or not
            if reply.public is not None:
                data = answer_with_model(data, reply.public)
        return data


class _Sends:
    """What every request to one account sends alike, built once (whichever model it is
    bound to: the account's copies share its spec and key)."""

    __slots__ = ("headers", "key", "spec")

    def __init__(self, account: Account) -> None:
        self.spec = account.spec
        self.key = account.api_key
        self.headers = [*account.auth_headers(), _IDENTITY]


async def _cloud_request(
    ctx: RequestContext,
    account: Account,
    path: str,
    headers: list[tuple[str, str]],
    body: bytes,
) -> tuple[str, list[tuple[str, str]], bytes] | Response:
    """A cloud account's URL, headers and body for the request: re-enveloped and signed.

    What it cannot take, or a credential it cannot get, is answered here in the client's
    wire: a credential refused as a 401 (the account's fault for every model), a token
    endpoint that did not answer in time as a 502 (an account fault: the request fails
    over). The message names the account.
    """
    wire = ctx.wire or Wire.ANTHROPIC
    try:
        outbound = await account.outbound(path, body, headers)
    except WireError as exc:
        return _error(wire, exc.status, exc.error_type, exc.message)
    except CloudCredentialError as exc:
        if exc.refused:
            return _error(wire, 401, "authentication_error", str(exc))
        return _error(wire, 502, "api_error", str(exc))
    return outbound.url, outbound.headers, outbound.body


def _error(wire: Wire, status: int, error_type: str, message: str) -> Response:
    body = error_body(wire, error_type, message)
    return Response(body, status_code=status, media_type="application/json")


def _limits(ctx: RequestContext) -> aiohttp.ClientTimeout:
    """The pooled call's own timeouts: what `timeout_for` gives httpx, in aiohttp's terms
    (connecting, waiting for a pooled connection and every read are each bounded by what is
    left of the deadline) -- unless the deadline policy's alarm already bounds the call."""
    if ctx.deadline_at is not None:
        # Only the deadline policy sets `deadline_at`, and its alarm cancels this call at the
        # deadline, the budget's end or (in a stream) once the upstream has been silent for
        # `stream_idle_secs`, and says which. One timer decides: a timer of the call's own
        # could only cut a healthy stream (aiohttp's read bound cannot tell the wait for the
        # response from a gap between chunks), or race the alarm and report an expiry as an
        # upstream failure; for a non-stream it would only cost a timer per read.
        return _UNTIMED
    secs = seconds_left(ctx)
    return aiohttp.ClientTimeout(total=None, connect=secs, sock_connect=secs, sock_read=secs)


_UNTIMED = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=None, sock_read=None)


async def _request_body(receive: Receive, first: Message) -> bytes:
    """The whole request body from its `first` message on, as Starlette's `Request.body()`
    reads it (and raises)."""
    try:
        # No limit of its own: under the stack the body was read, bounded and replayed.
        return await read_body(receive, limit=sys.maxsize, first=first)
    except ClientDisconnected:
        raise ClientDisconnect() from None


class _Reply:
    """An upstream answer from either client; its failures, while it is read too, go through
    `map_exceptions()`.

    `headers` are those relayed to the caller: names lowercased, duplicates kept, minus
    hop-by-hop ones, those the serving server sets itself and those that name the provider
    (`withheld`, read only by a cloud's error mapping). `public`: the model name the answer
    must carry, where the provider's differs (`answer_names`).
    """

    __slots__ = (
        "_aiohttp",
        "_httpx",
        "cloud",
        "content_type",
        "headers",
        "public",
        "request_id",
        "span",
        "status",
        "streams",
        "translator",
        "withheld",
    )

    def __init__(
        self,
        status: int,
        raw_headers: Iterable[tuple[bytes, bytes]],
        *,
        aiohttp_response: aiohttp.ClientResponse | None = None,
        httpx_response: httpx.Response | None = None,
    ) -> None:
        self.status = status
        self._aiohttp = aiohttp_response
        self._httpx = httpx_response
        self.span: trace.Span | None = None
        self.cloud: Account | None = None
        self.translator: StreamTranslator | None = None
        self.public: str | None = None
        headers: list[tuple[bytes, bytes]] = []
        self.withheld: list[tuple[bytes, bytes]] = []
        ids: list[tuple[bytes, bytes]] = []
        content_type: bytes | None = None
        for name, value in raw_headers:
            lowered = name.lower()
            kind = _KINDS.get(lowered)
            if kind is None:
                kind = _kind(lowered)
            if kind:
                if kind & _DROPPED:
                    continue
                if kind & _REQUEST_ID:
                    ids.append((lowered, value))
                if kind & _WITHHELD:
                    self.withheld.append((lowered, value))
                    continue
            if content_type is None and lowered == b"content-type":
                content_type = value
            headers.append((lowered, value))
        self.headers = headers
        self.request_id = request_id(ids) if ids else None
        """The provider's request id (`engine.provider_headers`); None: it sent none."""
        self.content_type = content_type.decode("latin-1") if content_type is not None else ""
        self.streams = self.content_type.startswith("text/event-stream") and status < 400

    def from_cloud(self, account: Account) -> None:
        """The answer of a cloud account: its stream translated if it is not Anthropic SSE
        (the hook a cloud with its own stream framing fills), its errors mapped once read."""
        self.cloud = account
        if self.status >= 300:
            return
        translator = account.stream_translator(self.content_type)
        if translator is not None:
            self.translator = translator
            self.streams = True
            self._set_content_type(translator.content_type)

    def cloud_error(self, data: bytes) -> bytes:
        """A cloud's error answer as the Anthropic API sends one (status and body)."""
        assert self.cloud is not None
        self.status, data = self.cloud.error_answer(
            self.status, data, [*self.headers, *self.withheld]
        )
        self._set_content_type(b"application/json")
        return data

    def _set_content_type(self, value: bytes) -> None:
        kept = [(k, v) for k, v in self.headers if k != b"content-type"]
        self.headers = [(b"content-type", value), *kept]
        self.content_type = value.decode("latin-1")

    @classmethod
    async def pooled(
        cls,
        pool: PooledTransport,
        url: str,
        headers: list[tuple[str, str]],
        body: bytes,
        limits: aiohttp.ClientTimeout,
    ) -> _Reply:
        with map_exceptions():
            response = await pool.session().request(
                "POST",
                url,
                headers=headers,
                data=upstream_body(body),
                allow_redirects=False,
                auto_decompress=False,
                timeout=limits,
            )
        return cls(response.status, response.raw_headers, aiohttp_response=response)

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
        with map_exceptions():  # already mapped if `http` is `make_http_client()`'s
            response = await http.send(upstream, stream=True)
        return cls(response.status_code, response.headers.raw, httpx_response=response)

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        with map_exceptions():
            if self._httpx is not None:
                async for chunk in self._httpx.aiter_raw():
                    yield chunk
                return
            assert self._aiohttp is not None
            async for chunk in self._aiohttp.content.iter_any():
                yield chunk

    async def read(self) -> bytes:
        with map_exceptions():
            if self._httpx is not None:
                return await self._httpx.aread()
            assert self._aiohttp is not None
            return await self._aiohttp.read()

    async def aclose(self) -> None:
        if self._httpx is not None:
            await self._httpx.aclose()
        elif self._aiohttp is not None:
            self._aiohttp.release()  # back to the pool when read whole; closed otherwise


async def _stream(reply: _Reply, ctx: RequestContext, send: Send) -> None:
    """Relay an event stream as ASGI messages, releasing the upstream however it ends.

    Not through Starlette's `StreamingResponse`: under a server of ASGI spec < 2.4 (uvicorn)
    it runs the stream in a task group beside a task waiting for the caller to leave, about a
    third of a short stream's CPU. The stack watches for that itself and cancels the request.
    """
    chunks = _relay(reply, ctx)
    if reply.span is not None:
        chunks = ot.traced(chunks, reply.span, ctx)
    try:
        await send(
            {"type": "http.response.start", "status": reply.status, "headers": reply.headers}
        )
        async for chunk in chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    except OSError:
        # What a server of ASGI spec 2.4 raises on a send to a caller that has left; Starlette
        # answers it so too, and the cooling policy must not count it against the account.
        raise ClientDisconnect() from None
    finally:
        await reply.aclose()


def _relay(reply: _Reply, ctx: RequestContext) -> AsyncIterator[bytes]:
    """The upstream's stream, passed on one whole event at a time and ended with the wire's
    error event if the upstream breaks (`relay_events`, which `relay_stream` shares)."""
    chunks = reply.chunks() if reply.translator is None else _translated(reply, ctx)
    return relay_events(chunks, ctx, ctx.wire or Wire.OPENAI_CHAT)


async def _translated(reply: _Reply, ctx: RequestContext) -> AsyncGenerator[bytes, None]:
    """A cloud's stream as Anthropic SSE: its translator's output, then what it holds at the
    end (raising if the stream ended mid-frame)."""
    translator = reply.translator
    assert translator is not None
    failed = False
    async for piece in reply.chunks():
        chunk = translator.feed(piece)
        failure = None if failed else translator.failure
        if failure is not None:
            # The cloud's stream carried its own error (Bedrock's exception message):
            # the client's stream ends with it, the cooling policy counts its status.
            ctx.report_upstream(failure)
            failed = True
        yield chunk
    yield translator.end()


def _unplaced(ctx: RequestContext | None) -> Response:
    """The answer to a request the stack gave no account: one for a model no account serves
    (the stack passes it on untouched, for an app that may serve it itself) is the caller's
    mistake, a 404 as the providers give it; without a stack the gateway is misconfigured."""
    if ctx is None or ctx.view is None:
        body = error_body(Wire.OPENAI_CHAT, "gateway_misconfigured", "no switchyard stack")
        return Response(body, status_code=500, media_type="application/json")
    wire = ctx.view.wire
    error = model_not_served(wire, ctx.resolved_model or ctx.view.model)
    body = error_body(wire, error.error_type, error.message)
    return Response(body, status_code=error.status, media_type="application/json")
