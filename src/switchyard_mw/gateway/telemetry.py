"""Telemetry of `gateway.Forwarder`'s outbound call: its CLIENT span and the `traceparent` it
sends (only with an SDK installed). The token usage it reports from answers and streams
(always: the request metrics count it) is read by `engine.usage`, as the ext_proc server's is."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
from opentelemetry import propagate, trace

from ..context import RequestContext
from ..telemetry import names as tm


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
