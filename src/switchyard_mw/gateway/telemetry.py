"""Telemetry of `gateway.Forwarder`'s outbound call: its CLIENT span and the `traceparent` it
sends (only with an SDK installed), and the token usage it reports from answers and streams
(always: the request metrics count it)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import msgspec
from opentelemetry import propagate, trace

from ..context import RequestContext
from ..telemetry import names as tm
from ..wire import Wire


def start_call(url: httpx.URL, base_url: str) -> trace.Span:
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


def propagated(headers: list[tuple[str, str]], span: trace.Span) -> list[tuple[str, str]]:
    """`headers` carrying `span`'s context, in place of any `traceparent` the caller sent.

    A sampled-out span is propagated too: the provider then keeps the same decision.
    """
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    names = {name.lower() for name in carrier}
    return [(k, v) for k, v in headers if k.lower() not in names] + list(carrier.items())


def answered(span: trace.Span, status: int) -> None:
    span.set_attribute(tm.HTTP_STATUS, status)
    if status >= 400:  # for a client span, every 4xx and 5xx is an error of the call
        span.set_attribute(tm.ERROR_TYPE, str(status))
        span.set_status(trace.StatusCode.ERROR)


def end_call(span: trace.Span | None, exc: BaseException) -> None:
    """End a call's span on an exception, naming only its type (its text may quote data)."""
    if span is None:
        return
    span.set_attribute(tm.ERROR_TYPE, type(exc).__qualname__)
    span.set_status(trace.StatusCode.ERROR)
    span.end()


async def traced(
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
            # The gateway's relay reports a stream the upstream broke off as a 502 upstream status.
            span.set_attribute(tm.ERROR_TYPE, "stream_interrupted")
            span.set_status(trace.StatusCode.ERROR)
        span.end()


class Usage(msgspec.Struct):
    input_tokens: int | None = None  # Anthropic Messages, OpenAI Responses
    output_tokens: int | None = None
    cache_read_input_tokens: int | None = None  # Anthropic counts cached input apart
    cache_creation_input_tokens: int | None = None
    prompt_tokens: int | None = None  # OpenAI Chat Completions
    completion_tokens: int | None = None


class Answer(msgspec.Struct):
    usage: Usage | None = None


ANSWER = msgspec.json.Decoder(Answer)  # skips every other field of the answer unread


def report_usage(ctx: RequestContext, body: bytes) -> None:
    """`ctx.report_usage` from a JSON answer's `usage`, in the GenAI conventions' terms:
    input tokens include cached ones."""
    try:
        usage = ANSWER.decode(body).usage
    except msgspec.DecodeError:
        return  # not a shape we know: report nothing rather than something wrong
    if usage is not None:
        _report(ctx, usage)


def _report(ctx: RequestContext, usage: Usage) -> None:
    if ctx.wire is Wire.OPENAI_CHAT or usage.input_tokens is None:
        ctx.report_usage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens)
        return
    inputs = usage.input_tokens
    if ctx.wire is Wire.ANTHROPIC:
        inputs += (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)
    ctx.report_usage(input_tokens=inputs, output_tokens=usage.output_tokens)


class _Event(msgspec.Struct):
    usage: Usage | None = None  # Anthropic `message_delta`, OpenAI Chat's last chunk
    message: Answer | None = None  # Anthropic `message_start`
    response: Answer | None = None  # OpenAI Responses `response.completed`


_EVENT = msgspec.json.Decoder(_Event)
_USAGE_FIELDS = tuple(Usage.__struct_fields__)


class StreamUsage:
    """The usage a stream reports along the way, merged: each wire says it in its own events
    (Anthropic: input in `message_start`, output in the last `message_delta`; OpenAI Chat:
    the final chunk, when the caller asked with `stream_options.include_usage`; Responses:
    `response.completed`). Fed whole events; only those naming `"usage"` are decoded."""

    __slots__ = ("seen",)

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}

    def feed(self, events: bytes) -> None:
        if b'"usage"' not in events:
            return  # nearly every event of a stream: one search, nothing decoded
        for line in events.splitlines():
            if line.startswith(b"data:") and b'"usage"' in line:
                self._take(line[5:])

    def _take(self, data: bytes) -> None:
        try:
            event = _EVENT.decode(data)
        except msgspec.DecodeError:
            return
        for holder in (event.usage, event.message, event.response):
            usage = holder.usage if isinstance(holder, Answer) else holder
            if usage is None:
                continue
            for name in _USAGE_FIELDS:
                value = getattr(usage, name)
                if value is not None:
                    self.seen[name] = value  # later events carry the running totals

    def report(self, ctx: RequestContext) -> None:
        if self.seen:
            _report(ctx, Usage(**self.seen))
