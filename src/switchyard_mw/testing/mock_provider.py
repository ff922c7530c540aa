"""A pure-ASGI mock of the Anthropic Messages, OpenAI Chat Completions and OpenAI
Responses APIs, for examples, demos and tests of LLM gateways.

Endpoints (POST): ``/v1/messages``, ``/v1/chat/completions``, ``/v1/responses``; each
answers in its own wire format, streams when the body says ``"stream": true``, and
echoes the requested ``model`` so a test can see where a gateway routed a call.
``/v1/messages/count_tokens`` answers ``{"input_tokens": N}`` as Anthropic's does.

How each request is answered is chosen by its API key (``x-api-key``, ``api-key`` or
``Authorization: Bearer``): see :class:`Behaviour`. Behaviours can be set in process
(:meth:`MockProvider.set_behaviour`) or over HTTP when the mock runs elsewhere::

    PUT    /_mock/behaviours/{key}   body: Behaviour fields as JSON ("*" = default)
    GET    /_mock/behaviours
    DELETE /_mock/behaviours[/{key}]
    GET    /_mock/requests           recorded LLM requests, bodies decoded as JSON
    DELETE /_mock/requests
    GET    /_mock/health
    PUT    /_mock/vertex/keys/{client_email}   body: a PEM public key to trust
    PUT    /_mock/vertex     body: {"token_lifetime_secs": N, "token_delay_secs": S}

It also plays Vertex AI (``POST /token``, a service account's ``token_uri``, and the
rawPredict/streamRawPredict paths, answered by the behaviour of the token's
``client_email``): see ``switchyard_mw.testing._vertex``.

A Bedrock face answers ``/model/{modelId}/invoke`` and ``.../invoke-with-response-stream``
(AWS Signature V4 checked, the binary event-stream framing; see ``_bedrock_face``); its
behaviours are keyed by the AWS access key id.

Run standalone with ``python -m switchyard_mw.testing.mock_provider --port 9100``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import gzip
import math
import re
import time
import uuid
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import msgspec

from switchyard_mw.errors import MockProviderFault
from switchyard_mw.testing import _bedrock_face as bedrock
from switchyard_mw.testing._asgi import (
    JSON_TYPE,
    Receive,
    Scope,
    Send,
    lifespan,
    read_body,
    send_empty,
    send_json,
    send_whole,
    unless_disconnected,
)
from switchyard_mw.testing._prefill import continued
from switchyard_mw.testing._prompt_cache import PromptCache
from switchyard_mw.testing._replies import ReplyContext, StreamPlan
from switchyard_mw.testing._tool_calls import split_text, tool_calls
from switchyard_mw.testing._vertex import (
    COUNT_TOKENS_MODEL,
    TOKEN_PATH,
    VertexCall,
    VertexFace,
    envelope_problem,
    send_google_error,
    vertex_call,
)
from switchyard_mw.testing._wire_replies import (
    ENDPOINTS,
    Endpoint,
    ErrorStyle,
    billing_body,
    context_length_body,
    error_body,
)
from switchyard_mw.wire import COUNT_TOKENS_PATH, on_fresh_stack

MOCK_AWS_ACCESS_KEY_ID = bedrock.MOCK_AWS_ACCESS_KEY_ID
MOCK_AWS_SECRET_ACCESS_KEY = bedrock.MOCK_AWS_SECRET_ACCESS_KEY

__all__ = [
    "DEFAULT_KEY",
    "DEFAULT_REPLY",
    "MOCK_AWS_ACCESS_KEY_ID",
    "MOCK_AWS_SECRET_ACCESS_KEY",
    "Behaviour",
    "MockProvider",
    "MockProviderFault",
    "RecordedRequest",
    "main",
]

DEFAULT_REPLY = "Hello from the mock provider."
THOUGHT = "The question is clear; the answer follows from it."
"""What the mock thinks when a request asks for thinking (Anthropic shows it; OpenAI counts it)."""
DEFAULT_KEY = "*"
"""The behaviour key that applies to every API key without a behaviour of its own."""

_DEFAULT_MODEL = "mock-model"
_SSE = b"text/event-stream; charset=utf-8"


class Behaviour(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How the mock answers requests made with one API key.

    Timeline of an answer: read the whole request, wait ``headers_delay_secs``, then
    either fail, send a wire error (``status`` 4xx/5xx), or reply.

    A reply is text, or tool calls when the request offers tools (see
    ``switchyard_mw.testing._tool_calls`` for when): ``tool_calls`` calls, their arguments
    ``tool_input`` or an example of the tool's schema.

    Streaming replies send the opening events at once, then ``chunks`` deltas (of the text,
    or of each call's arguments) ``chunk_interval_secs`` apart; after ``stall_after_chunks``
    deltas (0 = before the first: headers long before the first token) the stream waits
    ``body_stall_secs`` and, with ``fail="reset_mid_stream"``, aborts, or with
    ``fail="error_mid_stream"`` sends the wire's error event and ends. Non-streaming replies
    with a stall or a mid-stream fault send the headers first (chunked, no content-length)
    and stall or abort before the body.

    Usage counts 4 request bytes a token; ``cache_read_tokens`` and ``cache_write_tokens``
    are input tokens reported as read from and written to the prompt cache, on top of those.

    ``fail="no_response"`` holds the connection and sends nothing until the client leaves.
    ``fail="malformed_event"`` sends, in place of delta number ``stall_after_chunks``, an event
    whose JSON breaks off (a JSON answer: the body cut in half); ``fail="no_terminator"`` ends a
    stream without its last event (``[DONE]``, ``message_stop``, ``response.completed``).

    ``fail="reset_before_headers"`` raises before anything is sent. Under uvicorn this
    does not drop the connection: uvicorn answers ``500 Internal Server Error`` in
    text/plain with ``connection: close``. ``"reset_mid_stream"`` makes uvicorn close
    the connection with the chunked body unfinished. Through an in-process ASGI
    transport (httpx ``ASGITransport``) both surface as the exception itself, since
    that transport buffers the whole body.
    """

    status: int = 200
    headers_delay_secs: float = 0.0
    body_stall_secs: float = 0.0
    stall_after_chunks: int = 0
    chunk_interval_secs: float = 0.0
    reply: str | None = None
    chunks: int = 3
    fail: Literal[
        "none",
        "reset_before_headers",
        "reset_mid_stream",
        "error_mid_stream",
        "no_response",
        "malformed_event",
        "no_terminator",
    ] = "none"
    tool_calls: int = 1
    """How many tools a tool-call answer calls (the offered tools in turn)."""
    tool_input: dict[str, Any] | None = None
    """The arguments of every tool call; None: an example of each tool's schema."""
    text_before_tools: bool = False
    """A tool-call answer says the reply text first, as Claude often does (one text block,
    then the tool_use blocks; Chat's content beside tool_calls; a Responses message item)."""
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    stop_at_max_tokens: bool = False
    """A text answer longer than the request's output cap (`max_tokens`,
    `max_completion_tokens`, `max_output_tokens`) stops there and says so, as the real APIs
    do. Off by default: many callers ask for fewer tokens than the default reply's 7."""
    content_encoding: Literal["identity", "gzip"] = "identity"
    """"gzip": JSON answers come gzip-compressed to a request whose accept-encoding allows it,
    as the real APIs' CDNs may send them; streams stay uncompressed."""
    refuse: Literal["none", "context_length", "billing"] = "none"
    """"context_length": answer every request with the 400 the API sends for a prompt too
    long for the model, in its own shape (Anthropic's `invalid_request_error` "prompt is too
    long", OpenAI's `context_length_exceeded` on Chat and Responses), streams included.
    "billing": answer every request as the API answers an account whose credit or quota is
    spent: Anthropic's 400 `invalid_request_error` "Your credit balance is too low...",
    OpenAI's 429 `insufficient_quota` (Chat and Responses; with `retry-after: 1`, as the mock's
    429s say, unless `headers` says otherwise), streams included."""
    headers: dict[str, str] | None = None
    """Headers of an error answer: None sends the usual ones (a 429 says `retry-after: 1`,
    as both real APIs do); a mapping (even empty) sends exactly those, e.g. a 429 with
    `retry-after-ms` or a provider's rate-limit reset headers, or with no retry time."""
    bedrock_exception: str | None = None
    """The Bedrock face only: the exception an error answer (`status`) or a mid-stream error
    is named by, e.g. `"ModelNotReadyException"` with status 429 (None: the status's usual
    one, `ThrottlingException` for 429; mid-stream `ServiceUnavailableException`)."""
    status_for_secs: float | None = None
    """An error `status` lasts this long from when the behaviour was set, then the key is
    answered as with 200 (a provider that healed); None: as long as the behaviour is set."""
    status_models: list[str] | None = None
    """An error `status` (and its `status_for_secs`) answers requests for these models only;
    the others are answered as with 200 (one model of a key overloaded). None: every model."""
    times: int = 0
    """Misbehave (status, fail, delays, stall, refusal) for the first `times` requests made
    with this key since the behaviour was set, then answer healthily: `status=500, times=1` is
    "500 once" (0: every request)."""
    for_secs: float = 0.0
    """Misbehave for this long after the behaviour was set, then answer healthily:
    `status=503, for_secs=60` is an outage of a minute (0: for ever). With `times`, whichever
    ends first."""
    content_filter: bool = False
    """The answer is stopped by the provider's content filter, in each wire's shape: Anthropic
    `stop_reason: "refusal"`, Chat `finish_reason: "content_filter"`, Responses `status:
    "incomplete"` with `incomplete_details.reason: "content_filter"` (a stream ends with
    `response.incomplete`). `reply` sets the text said before it (e.g. "")."""

    def __post_init__(self) -> None:
        # Checked here rather than with msgspec.Meta so direct construction is
        # validated too, not only decoding from the control endpoint.
        if self.status != 200 and not 400 <= self.status <= 599:
            raise ValueError(f"status must be 200 or within 400..599, got {self.status}")
        if self.chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {self.chunks}")
        for count in ("stall_after_chunks", "cache_read_tokens", "cache_write_tokens"):
            if getattr(self, count) < 0:
                raise ValueError(f"{count} must be >= 0, got {getattr(self, count)}")
        if self.tool_calls < 1:
            raise ValueError(f"tool_calls must be >= 1, got {self.tool_calls}")
        if self.times < 0:
            raise ValueError(f"times must be >= 0, got {self.times}")
        for name in ("headers_delay_secs", "body_stall_secs", "chunk_interval_secs", "for_secs"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.status_for_secs is not None and not self.status_for_secs >= 0:
            raise ValueError(f"status_for_secs must be >= 0, got {self.status_for_secs}")


class RecordedRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One LLM request as the mock received it."""

    path: str
    key: str
    """The API key, or "" when the request carried none."""
    model: str | None
    stream: bool
    body: bytes
    headers: dict[str, str]
    """Header names lowercased; a repeated header keeps its last value."""
    tool_call_ids: tuple[str, ...] = ()
    """The ids of the tool calls the mock answered with (none: text, or an error)."""


class MockProvider:
    """The mock provider as an ASGI app: the three LLM wires and the `/_mock` control API.

    One instance holds its behaviours (by API key) and its request records (the last
    `max_recorded_requests`). Serve it with any ASGI server, or mount it in process (an
    `httpx.ASGITransport`) in a test; `switchyard-mw mock` serves one.
    """

    def __init__(
        self,
        *,
        reply: str = DEFAULT_REPLY,
        max_recorded_requests: int = 10_000,
        cache_ttl_secs: float = 300.0,
        aws_credentials: dict[str, str] | None = None,
    ) -> None:
        self.default_reply = reply
        # The Bedrock face's secrets by access key id, to check each request's signature.
        self.aws_credentials = (
            {bedrock.MOCK_AWS_ACCESS_KEY_ID: bedrock.MOCK_AWS_SECRET_ACCESS_KEY}
            if aws_credentials is None
            else dict(aws_credentials)
        )
        # A prompt cache per API key: a prefix seen under the key within the TTL is a cache
        # read, reported in usage as each wire does (so affinity's effect shows offline).
        self.prompt_cache = PromptCache(ttl_secs=cache_ttl_secs)
        self._behaviours: dict[str, Behaviour] = {}
        self._set_at: dict[str, float] = {}  # key -> when its behaviour was set (monotonic)
        # Bounded so that a long soak test against one mock cannot grow without limit.
        self._records: collections.deque[RecordedRequest] = collections.deque(
            maxlen=max_recorded_requests
        )
        self._in_flight = 0
        self.vertex = VertexFace()
        """The Vertex AI face: its token endpoint (`POST /token`) and the tokens it issued."""
        # Per behaviour key: how many requests it answered since it was set (`times`).
        self._answered: collections.Counter[str] = collections.Counter()

    # --- in-process control -------------------------------------------------------------

    def set_behaviour(self, key: str, behaviour: Behaviour) -> None:
        """Answer requests made with `key` this way from now on (`"*"`: every other key)."""
        self._behaviours[key] = behaviour
        self._set_at[key] = time.monotonic()
        self._answered[key] = 0

    def clear_behaviour(self, key: str) -> None:
        """Forget `key`'s behaviour: it gets the `"*"` one again, else a fast 200."""
        self._behaviours.pop(key, None)

    def behaviour_for(self, key: str) -> Behaviour:
        """How a request made with `key` is answered now."""
        if key in self._behaviours:
            return self._behaviours[key]
        return self._behaviours.get(DEFAULT_KEY, Behaviour())

    @property
    def behaviours(self) -> dict[str, Behaviour]:
        """A snapshot of the behaviours set, by key."""
        return dict(self._behaviours)

    @property
    def requests(self) -> list[RecordedRequest]:
        """A snapshot of the recorded LLM requests, oldest first."""
        return list(self._records)

    @property
    def in_flight(self) -> int:
        """LLM requests being answered now; lets a test check a gateway hung up upstream."""
        return self._in_flight

    def clear_requests(self) -> None:
        """Forget the recorded requests."""
        self._records.clear()

    def reset_behaviours(self) -> None:
        """Forget every behaviour: each key gets a fast 200."""
        self._behaviours.clear()

    def reset(self) -> None:
        """Forget all behaviours and recorded requests."""
        self.reset_behaviours()
        self.clear_requests()
        self.prompt_cache.clear()
        self.vertex.reset()

    # --- ASGI ---------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        body = await read_body(receive)
        if body is None:
            return
        method: str = scope["method"]
        path: str = scope["path"]
        call = bedrock.route(path) if method == "POST" else None
        if call is not None:
            await self._bedrock(call, scope, body, send, receive)
            return
        endpoint = ENDPOINTS.get(path) or _deployment_endpoint(path)
        vertex = None if endpoint is not None else vertex_call(path)
        if vertex is not None and method == "POST":
            self._in_flight += 1
            try:
                await unless_disconnected(self._answer_vertex(vertex, scope, body, send), receive)
            finally:
                self._in_flight -= 1
        elif path == TOKEN_PATH and method == "POST":
            await self.vertex.answer_token(body, send)
        elif path == COUNT_TOKENS_PATH and method == "POST":
            self._in_flight += 1
            try:
                key = _api_key(_headers(scope))
                await unless_disconnected(self._count_tokens(key, scope, body, send), receive)
            finally:
                self._in_flight -= 1
        elif endpoint is not None and method == "POST":
            self._in_flight += 1
            try:
                work = self._answer(endpoint, scope, body, send)
                await unless_disconnected(work, receive)
            finally:
                self._in_flight -= 1
        elif endpoint is not None:
            await _send_error(send, "openai", 405, f"Method {method} not allowed on {path}")
        elif path.startswith("/_mock/"):
            await self._control(method, path.removeprefix("/_mock/"), body, send)
        else:
            await _send_error(send, "openai", 404, f"Invalid URL ({method} {path})")

    async def _bedrock(
        self, call: bedrock.BedrockCall, scope: Scope, body: bytes, send: Send, receive: Receive
    ) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        key = bedrock.verify(scope, headers, body, self.aws_credentials)
        if isinstance(key, bedrock.Refusal):
            await bedrock.send_error(send, 403, key.message, exception=key.exception)
            return
        call = dataclasses.replace(call, key=key)
        self._in_flight += 1
        try:
            work = self._answer(ENDPOINTS["/v1/messages"], scope, body, send, bedrock_call=call)
            await unless_disconnected(work, receive)
        finally:
            self._in_flight -= 1

    async def _answer_vertex(self, call: VertexCall, scope: Scope, body: bytes, send: Send) -> None:
        """A rawPredict call: a live token of the token endpoint's, the Vertex envelope,
        then the Messages answer of the token's service account's behaviour."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        holder = self.vertex.holder(_api_key(headers))
        if holder is None:
            message = "Request had invalid authentication credentials."
            await send_google_error(send, 401, message)
            return
        try:
            payload = _decode(body)
        except (msgspec.DecodeError, RecursionError):
            payload = None
        problem = envelope_problem(payload, call)
        if problem is not None:
            await send_google_error(send, 400, problem)
            return
        if call.model == COUNT_TOKENS_MODEL:
            await self._count_tokens(holder, scope, body, send, vertex=True)
            return
        endpoint = ENDPOINTS["/v1/messages"]
        await self._answer(endpoint, scope, body, send, vertex=(holder, call.model))

    async def _answer(
        self,
        endpoint: Endpoint,
        scope: Scope,
        body: bytes,
        send: Send,
        *,
        vertex: tuple[str, str] | None = None,
        bedrock_call: bedrock.BedrockCall | None = None,
    ) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        key = _api_key(headers) if bedrock_call is None else bedrock_call.key
        try:
            # Like a provider that reads any JSON its parser can: as deep as the gateway's
            # reader allows (a body nested deeper than that is a 400 here too).
            payload = _decode(body)
        except (msgspec.DecodeError, RecursionError):
            payload = None
        fields: dict[str, Any] = payload if isinstance(payload, dict) else {}
        if vertex is not None:  # the service account answers, and the path names the model
            key, fields = vertex[0], {**fields, "model": vertex[1]}
        model = fields.get("model") if isinstance(fields.get("model"), str) else None
        stream = fields.get("stream") is True
        invalid = None
        if bedrock_call is not None:  # the model in the path, the endpoint says if it streams
            invalid = bedrock.body_problem(fields) if isinstance(payload, dict) else None
            model, stream = bedrock_call.model, bedrock_call.stream
            fields = {**fields, "model": bedrock.anthropic_name(model)}
        behaviour = self._in_effect(key, self._in_force(key, model, self.behaviour_for(key)))
        ctx = None
        if behaviour.status == 200 and isinstance(payload, dict) and invalid is None:
            ctx = self._reply_context(endpoint, fields, behaviour, len(body))
            if not (behaviour.cache_read_tokens or behaviour.cache_write_tokens):
                ctx = self._cached(ctx, key, model, fields)  # set counts win over the cache
        self._records.append(
            RecordedRequest(
                path=scope["path"],
                key=key,
                model=model,
                stream=stream,
                body=body,
                headers=headers,
                tool_call_ids=tuple(call.call_id for call in ctx.calls) if ctx else (),
            )
        )

        await _sleep(behaviour.headers_delay_secs)
        if behaviour.fail == "reset_before_headers":
            raise MockProviderFault("fail=reset_before_headers")
        if behaviour.fail == "no_response":
            await asyncio.Event().wait()  # until the client leaves (and cancels this)
        if bedrock_call is not None:
            await self._bedrock_answer(endpoint, ctx, behaviour, send, invalid, stream)
        elif behaviour.refuse != "none":
            await _send_refusal(send, endpoint, behaviour, len(body))
        elif behaviour.status != 200 and vertex is not None and behaviour.status != 529:
            # Vertex's own errors come in Google's shape; the model's (529) in Anthropic's.
            message = f"Mock Vertex AI answering {behaviour.status} for this service account."
            await send_google_error(send, behaviour.status, message, behaviour.headers)
        elif behaviour.status != 200:
            message = f"Mock provider answering {behaviour.status} for this API key."
            await _send_error(send, endpoint.errors, behaviour.status, message, behaviour.headers)
        elif ctx is None:
            await _send_error(send, endpoint.errors, 400, "Request body is not a JSON object.")
        elif stream:
            await _stream(endpoint, ctx, behaviour, send)
        else:
            gzipped = behaviour.content_encoding == "gzip" and _accepts_gzip(headers)
            await _reply(endpoint, ctx, behaviour, send, gzipped=gzipped)

    async def _count_tokens(
        self, key: str, scope: Scope, body: bytes, send: Send, *, vertex: bool = False
    ) -> None:
        """Anthropic's token counting: `{"input_tokens": N}`, N the input tokens a Messages
        call of this body would report (4 bytes a token), or the key's error as
        `/v1/messages` would answer it (its status, delay and reset apply; its reply not).
        Through Vertex (`count-tokens:rawPredict`) its errors but 529 are in Google's shape."""
        headers = _headers(scope)
        try:
            payload = _decode(body)
        except (msgspec.DecodeError, RecursionError):
            payload = None
        fields: dict[str, Any] = payload if isinstance(payload, dict) else {}
        model = fields.get("model") if isinstance(fields.get("model"), str) else None
        behaviour = self._in_effect(key, self._in_force(key, model, self.behaviour_for(key)))
        record = RecordedRequest(
            path=scope["path"], key=key, model=model, stream=False, body=body, headers=headers
        )
        self._records.append(record)
        await _sleep(behaviour.headers_delay_secs)
        if behaviour.fail == "reset_before_headers":
            raise MockProviderFault("fail=reset_before_headers")
        if behaviour.status != 200 and vertex and behaviour.status != 529:
            message = f"Mock Vertex AI answering {behaviour.status} for this service account."
            await send_google_error(send, behaviour.status, message, behaviour.headers)
        elif behaviour.status != 200:
            message = f"Mock provider answering {behaviour.status} for this API key."
            await _send_error(send, "anthropic", behaviour.status, message, behaviour.headers)
        elif model is None or not isinstance(fields.get("messages"), list):
            message = "model and messages: required"
            await _send_error(send, "anthropic", 400, message)
        else:
            await send_json(send, 200, {"input_tokens": max(1, len(body) // 4)})

    async def _bedrock_answer(
        self,
        endpoint: Endpoint,
        ctx: ReplyContext | None,
        behaviour: Behaviour,
        send: Send,
        refusal: str | None,
        stream: bool,
    ) -> None:
        if behaviour.status != 200:
            message = f"Mock provider answering {behaviour.status} for this access key."
            await bedrock.send_error(
                send,
                behaviour.status,
                message,
                exception=behaviour.bedrock_exception,
                headers=behaviour.headers,
            )
        elif ctx is None:
            await bedrock.send_error(send, 400, refusal or "Malformed input request")
        elif stream:
            framed = bedrock.EventStreamSend(send)
            if behaviour.bedrock_exception is not None:
                framed.exception = behaviour.bedrock_exception
            await _stream(endpoint, ctx, behaviour, framed)
        else:
            await _reply(endpoint, ctx, behaviour, send, gzipped=False)

    def _in_effect(self, key: str, behaviour: Behaviour) -> Behaviour:
        """`key`'s `behaviour` for this request: healthy once its `times` or `for_secs` ran
        out."""
        found = key if key in self._behaviours else DEFAULT_KEY
        if not (behaviour.times or behaviour.for_secs):
            return behaviour
        self._answered[found] += 1
        over = behaviour.times and self._answered[found] > behaviour.times
        elapsed = time.monotonic() - self._set_at.get(found, -math.inf)
        if over or (behaviour.for_secs and elapsed >= behaviour.for_secs):
            return _healthy(behaviour)
        return behaviour

    def _cached(
        self, ctx: ReplyContext, key: str, model: str | None, fields: dict[str, Any]
    ) -> ReplyContext:
        """`ctx` with its input split into what the prompt cache read, wrote and neither."""
        try:
            cached, prompt = self.prompt_cache.read(key, model, fields)
        except RecursionError:  # a body nested past what can be encoded: nothing cached
            cached = prompt = 0
        total = ctx.input_tokens
        read = min(cached // 4, total)
        written = min(max(0, prompt // 4 - read), total - read)
        return dataclasses.replace(
            ctx,
            input_tokens=total - read - written,
            cache_read_tokens=read,
            cache_write_tokens=written,
        )

    def _reply_context(
        self, endpoint: Endpoint, fields: dict[str, Any], behaviour: Behaviour, size: int
    ) -> ReplyContext:
        text = behaviour.reply if behaviour.reply is not None else self.default_reply
        text = continued(text, endpoint.prefill(fields))  # after a prefill, only the rest
        calls = tool_calls(
            endpoint.offer(fields),
            vendor=endpoint.errors,
            count=behaviour.tool_calls,
            pieces=behaviour.chunks,
            tool_input=behaviour.tool_input,
        )
        thought = THOUGHT if endpoint.thinks(fields) else ""
        cap = _cap(fields, endpoint.caps) if behaviour.stop_at_max_tokens and not calls else None
        cut_short = cap is not None and _tokens(thought) + _tokens(text) > cap
        if cap is not None and cut_short:
            # The thought is spent first; the text gets what is left, 4 bytes a token.
            room = max(0, cap - _tokens(thought)) * 4
            text = text.encode()[:room].decode("utf-8", "ignore")
        said = "".join(c.name + c.arguments for c in calls)
        if behaviour.text_before_tools or not calls:
            said += text
        options = fields.get("stream_options")
        model = fields.get("model")
        return ReplyContext(
            model=model if isinstance(model, str) and model else _DEFAULT_MODEL,
            text=text,
            parts=split_text(text, behaviour.chunks),
            # Rough "4 bytes a token" figures: plausible, stable and free to compute.
            input_tokens=max(1, size // 4),
            output_tokens=cap if cap is not None and cut_short else _spent(said, thought),
            include_usage=isinstance(options, dict) and options.get("include_usage") is True,
            calls=calls,
            text_first=behaviour.text_before_tools,
            thought=thought,
            thought_parts=split_text(thought, behaviour.chunks),
            reasoning_tokens=_tokens(thought),
            cache_read_tokens=behaviour.cache_read_tokens,
            cache_write_tokens=behaviour.cache_write_tokens,
            cut_short=cut_short,
            refused=behaviour.content_filter,
        )

    def _in_force(self, key: str, model: str | None, behaviour: Behaviour) -> Behaviour:
        """`behaviour` with its error status dropped where `status_models` or
        `status_for_secs` say it does not apply (to this model, or any more)."""
        if behaviour.status == 200 or (
            behaviour.status_for_secs is None and behaviour.status_models is None
        ):
            return behaviour
        models = behaviour.status_models
        if models is not None and model not in models:
            return msgspec.structs.replace(behaviour, status=200)
        if behaviour.status_for_secs is not None:
            set_at = self._set_at.get(key if key in self._behaviours else DEFAULT_KEY, 0.0)
            if time.monotonic() - set_at >= behaviour.status_for_secs:
                return msgspec.structs.replace(behaviour, status=200)
        return behaviour

    async def _control(self, method: str, route: str, body: bytes, send: Send) -> None:
        if route == "health" and method == "GET":
            await send_json(send, 200, {"status": "ok"})
        elif route == "requests" and method == "GET":
            await send_json(send, 200, [_record_json(r) for r in self._records])
        elif route == "requests" and method == "DELETE":
            self.clear_requests()
            await send_empty(send)
        elif route == "behaviours" and method == "GET":
            await send_json(send, 200, self._behaviours)
        elif route == "behaviours" and method == "DELETE":
            self.reset_behaviours()
            await send_empty(send)
        elif route.startswith("vertex"):
            await self._control_vertex(method, route.removeprefix("vertex"), body, send)
        elif route.startswith("behaviours/") and method in ("PUT", "DELETE"):
            key = route.removeprefix("behaviours/")
            if method == "DELETE":
                self.clear_behaviour(key)
                await send_empty(send)
                return
            try:
                behaviour = msgspec.json.decode(body or b"{}", type=Behaviour)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                await _send_error(send, "openai", 400, f"Invalid behaviour: {exc}")
                return
            self.set_behaviour(key, behaviour)
            await send_json(send, 200, behaviour)
        else:
            await _send_error(send, "openai", 404, f"No control route {method} /_mock/{route}")

    async def _control_vertex(self, method: str, route: str, body: bytes, send: Send) -> None:
        """`PUT /_mock/vertex/keys/{client_email}` (a PEM public key): trust that service
        account's key; `PUT /_mock/vertex` ({"token_lifetime_secs", "token_delay_secs"})."""
        if method == "PUT" and route.startswith("/keys/") and len(route) > len("/keys/"):
            self.vertex.trust(route.removeprefix("/keys/"), body)
            await send_empty(send)
        elif method == "PUT" and route == "":
            try:
                timings = msgspec.json.decode(body or b"{}", type=_VertexTimings)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                await _send_error(send, "openai", 400, f"Invalid Vertex settings: {exc}")
                return
            if timings.token_lifetime_secs is not None:
                self.vertex.token_lifetime_secs = timings.token_lifetime_secs
            if timings.token_delay_secs is not None:
                self.vertex.token_delay_secs = timings.token_delay_secs
            await send_empty(send)
        else:
            await _send_error(
                send, "openai", 404, f"No control route {method} /_mock/vertex{route}"
            )


class _VertexTimings(msgspec.Struct, forbid_unknown_fields=True):
    token_lifetime_secs: Annotated[int, msgspec.Meta(ge=1)] | None = None
    token_delay_secs: Annotated[float, msgspec.Meta(ge=0)] | None = None


# --- answering ----------------------------------------------------------------------------


async def _reply(
    endpoint: Endpoint, ctx: ReplyContext, behaviour: Behaviour, send: Send, *, gzipped: bool
) -> None:
    data = endpoint.reply(ctx)
    extra = [_request_id(endpoint.errors), _organization(endpoint.errors)]
    if gzipped:
        data = gzip.compress(data, mtime=0)
        extra.append((b"content-encoding", b"gzip"))
    if behaviour.fail == "malformed_event":
        data = data[: len(data) // 2]  # a JSON answer that breaks off mid-object
    if behaviour.body_stall_secs <= 0 and behaviour.fail in _WHOLE:
        await send_whole(send, 200, JSON_TYPE, data, extra)
        return
    # No content-length, so the server has to send the headers now and chunk the body:
    # the client sees a response that started and then went quiet.
    headers = [(b"content-type", JSON_TYPE), *extra]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await _hiccup(behaviour)
    if behaviour.fail == "error_mid_stream":
        # A JSON answer has no event to carry an error once it started: it breaks off.
        raise MockProviderFault("fail=error_mid_stream")
    await send({"type": "http.response.body", "body": data})


async def _stream(endpoint: Endpoint, ctx: ReplyContext, behaviour: Behaviour, send: Send) -> None:
    plan = endpoint.stream(ctx)
    headers = [
        (b"content-type", _SSE),
        (b"cache-control", b"no-cache"),
        _request_id(endpoint.errors),
        _organization(endpoint.errors),
    ]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": plan.prelude, "more_body": True})
    for index, frame in enumerate(plan.deltas):
        if index > 0:
            await _sleep(behaviour.chunk_interval_secs)
        if index == behaviour.stall_after_chunks and not await _hiccup(behaviour):
            await _break_off(endpoint, plan, index, send)
            return
        if index == behaviour.stall_after_chunks and behaviour.fail == "malformed_event":
            frame = _malformed(frame)
        await send({"type": "http.response.body", "body": frame, "more_body": True})
    if behaviour.stall_after_chunks >= len(plan.deltas) and not await _hiccup(behaviour):
        await _break_off(endpoint, plan, len(plan.deltas), send)
        return
    epilogue = plan.epilogue
    if behaviour.fail == "no_terminator":
        epilogue = _without_last_event(epilogue)
    await send({"type": "http.response.body", "body": epilogue})


def _malformed(frame: bytes) -> bytes:
    """`frame` with the JSON of its `data:` line broken off halfway (still one event)."""
    lines = frame.rstrip(b"\n").split(b"\n")
    cut = [line[: (len(line) + 6) // 2] if line.startswith(b"data: ") else line for line in lines]
    return b"\n".join(cut) + b"\n\n"


def _without_last_event(events: bytes) -> bytes:
    """`events` (SSE, each ending in a blank line) without the last: the stream's terminator."""
    head, _, _ = events.rstrip(b"\n").rpartition(b"\n\n")
    return head + b"\n\n" if head else b""


def _healthy(behaviour: Behaviour) -> Behaviour:
    """`behaviour` once its `times` or `for_secs` is over: the same reply, tools and pacing,
    without the fault."""
    return msgspec.structs.replace(
        behaviour,
        status=200,
        fail="none",
        headers_delay_secs=0.0,
        body_stall_secs=0.0,
        headers=None,
        content_filter=False,
        refuse="none",
        times=0,
        for_secs=0.0,
    )


_WHOLE = frozenset({"none", "malformed_event", "no_terminator"})
"""Faults that leave a JSON (not streamed) answer whole: it is sent at once."""


_DEPLOYMENT = re.compile(r"/openai/deployments/[^/]+(/chat/completions|/responses)\Z")


def _deployment_endpoint(path: str) -> Endpoint | None:
    """An Azure-style deployment path (`/openai/deployments/NAME/chat/completions`) answers
    as the OpenAI wire it ends in: for accounts with a `path` template."""
    match = _DEPLOYMENT.match(path)
    return None if match is None else ENDPOINTS["/v1" + match.group(1)]


async def _hiccup(behaviour: Behaviour) -> bool:
    """Stall as the behaviour says; False when the stream is to end with an error event."""
    await _sleep(behaviour.body_stall_secs)
    if behaviour.fail == "reset_mid_stream":
        raise MockProviderFault("fail=reset_mid_stream")
    return behaviour.fail != "error_mid_stream"


async def _break_off(endpoint: Endpoint, plan: StreamPlan, sent: int, send: Send) -> None:
    # Events end in a blank line (JSON inside has none): the count so far numbers the next.
    sequence = (plan.prelude + b"".join(plan.deltas[:sent])).count(b"\n\n")
    event = endpoint.stream_error(sequence, "Mock provider overloaded mid-stream.")
    await send({"type": "http.response.body", "body": event})


def _organization(style: ErrorStyle) -> tuple[bytes, bytes]:
    # Both APIs name the organization the key belongs to on their answers.
    if style == "anthropic":
        return b"anthropic-organization-id", b"00000000-0000-4000-8000-00000000m0c1"
    return b"openai-organization", b"mock-org"


def _request_id(style: ErrorStyle) -> tuple[bytes, bytes]:
    # Both APIs name each answer, errors included; the SDKs expose it as `_request_id`.
    name = b"request-id" if style == "anthropic" else b"x-request-id"
    return name, b"req_" + uuid.uuid4().hex[:24].encode()


async def _send_refusal(send: Send, endpoint: Endpoint, behaviour: Behaviour, size: int) -> None:
    """The provider's refusal `behaviour.refuse` names, in its own words: the context window
    exceeded (a body of `size` bytes, 4 a token, past 200,000 tokens) or the account's
    billing."""
    wire = next(path for path, e in ENDPOINTS.items() if e is endpoint)
    extra = [_request_id(endpoint.errors)]
    if behaviour.refuse == "context_length":
        refusal = context_length_body(wire, 200_000 + size // 4)
        await send_whole(send, 400, JSON_TYPE, refusal, extra)
        return
    status, refusal = billing_body(wire)
    if behaviour.headers is not None:
        extra += [(k.encode(), v.encode()) for k, v in behaviour.headers.items()]
    elif status == 429:
        extra.append((b"retry-after", b"1"))
    await send_whole(send, status, JSON_TYPE, refusal, extra)


async def _sleep(secs: float) -> None:
    if secs > 0:
        await asyncio.sleep(secs)


def _cap(fields: dict[str, Any], names: tuple[str, ...]) -> int | None:
    for name in names:
        value = fields.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
    return None


def _spent(said: str, thought: str) -> int:
    return max(1, len(said.encode()) // 4) + _tokens(thought)


def _tokens(text: str) -> int:
    return max(1, len(text.encode()) // 4) if text else 0


def _accepts_gzip(headers: dict[str, str]) -> bool:
    for coding in headers.get("accept-encoding", "").split(","):
        name, _, params = coding.strip().partition(";")
        if name.strip().lower() in ("gzip", "*"):
            return params.replace(" ", "") not in ("q=0", "q=0.0", "q=0.00", "q=0.000")
    return False


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


def _api_key(headers: dict[str, str]) -> str:
    if "x-api-key" in headers:
        return headers["x-api-key"]
    if "api-key" in headers:  # Azure OpenAI's
        return headers["api-key"]
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _record_json(record: RecordedRequest) -> dict[str, Any]:
    body: Any
    try:
        body = msgspec.json.decode(record.body)
    except (msgspec.DecodeError, RecursionError):
        body = record.body.decode("utf-8", "replace")
    return {**msgspec.structs.asdict(record), "body": body}


def _decode(body: bytes) -> Any:
    try:
        return msgspec.json.decode(body)
    except RecursionError:
        return on_fresh_stack(msgspec.json.decode, body)


async def _send_error(
    send: Send,
    style: ErrorStyle,
    status: int,
    message: str,
    headers: dict[str, str] | None = None,
) -> None:
    if headers is None:
        # Both real APIs send retry-after on 429, and the SDKs' retry logic reads it.
        extra = [(b"retry-after", b"1")] if status == 429 else []
    else:
        extra = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    extra.append(_request_id(style))
    await send_whole(send, status, JSON_TYPE, error_body(style, status, message), extra)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m switchyard_mw.testing.mock_provider",
        description="Serve the mock Anthropic/OpenAI provider over HTTP.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9100)
    parser.add_argument("--reply", default=DEFAULT_REPLY, help="default reply text")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    try:
        import uvicorn
    except ImportError:
        # uvicorn comes with the `example` extra (and `dev`), not with the middlewares.
        parser.exit(
            2,
            "error: the mock provider server needs uvicorn: "
            "pip install uvicorn (it comes with the 'example' extra)\n",
        )
    app = MockProvider(reply=args.reply)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
