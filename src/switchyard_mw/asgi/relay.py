"""Relaying an upstream's event stream to the client, one whole event at a time.

The forwarding app's streams and a team's own app (`relay_stream`) pass through the one loop
here, `relay_events`: it holds back the tail of a chunk that ends inside an event, tallies the
stream's usage for the request's metrics, writes the public model name into the events that
name the model where the account knows it by another name (`answer_names`), and when the
upstream breaks mid-stream (a reset, a cut connection, a read timeout) ends the client's
stream with the wire's error event instead of a cut connection: the client already has a 200,
and its SDK reports the error event as an error (a cut connection is a `TypeError:
terminated` in the Vercel AI SDK, a connection error in the Python SDKs, and a traceback in
the server's log).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing

import httpx

from ..answer_names import StreamNamer
from ..clients.outbound import map_exceptions
from ..context import RequestContext, current_context
from ..engine.usage import StreamUsage, report_tokens
from ..errors import TransportError
from ..wire import WIRE_PATHS, Wire, sequence_for, stream_error_event

BROKEN_STREAM_STATUS = 502
"""What a stream that broke mid-way counts as for the cooling policy: the upstream's fault."""


def relay_stream(answer: httpx.Response) -> AsyncIterator[bytes]:
    """The body of an upstream's streamed answer, for the app's own streaming response.

    `answer` is an `httpx` response sent with `stream=True` (`client.send(request,
    stream=True)`), whose body has not been read. The bytes come as the upstream sends them,
    one whole SSE event at a time; the answer is closed however the stream ends (the client
    leaving included). If the upstream breaks mid-stream, the stream ends with the error event
    of the request's wire (Anthropic's `event: error`, Chat Completions' error chunk, the
    Responses API's `event: error` numbered after the last event) instead of a cut
    connection, the break is counted against the account as a 502, and the usage the stream
    reported reaches the request's metrics. Where the account knows the model by another name,
    the events that name the model name the public one (`Account.answer_namer`).

    Any framework's streaming response takes it: Starlette's and FastAPI's
    `StreamingResponse(relay_stream(answer), ...)`, Litestar's `Stream`, Django's
    `StreamingHttpResponse`. Call it in the endpoint, under the stack: the request's context
    is read there (without one, the wire is read from the upstream URL's path).
    """
    ctx = current_context()
    wire = ctx.wire if ctx is not None and ctx.wire is not None else _wire_of(answer)
    return relay_events(_body(answer), ctx, wire)


async def relay_events(
    chunks: AsyncGenerator[bytes, None], ctx: RequestContext | None, wire: Wire
) -> AsyncIterator[bytes]:
    """`chunks` of an event stream passed on one whole event at a time, ended with `wire`'s
    error event if reading them raises a `TransportError`; `chunks` is closed however the
    relay ends (closed itself when the client leaves).

    A chunk may end inside an event; that tail waits for the rest, so that if the upstream
    dies there, the client's stream ends with a clean error event instead of half a frame
    glued to it. A stream the upstream itself ends mid-event is passed on as it was sent.
    """
    pending = b""
    usage = StreamUsage(wire)
    sequence = sequence_for(wire)  # numbers the error event on a Responses stream
    account = None if ctx is None else ctx.account
    public = None if account is None else account.answer_name
    namer = None if public is None else StreamNamer(public)
    try:
        async with aclosing(chunks):
            async for chunk in chunks:
                data = pending + chunk if pending else chunk
                cut = events_end(data)
                pending = data[cut:]
                if cut:
                    events = data if cut == len(data) else data[:cut]
                    usage.feed(events)
                    if sequence is not None:
                        sequence.feed(events)
                    yield events if namer is None else namer.feed(events)  # whole lines
    except TransportError as exc:  # mapped by `map_exceptions()`, from either client
        # The client already has a 200: end its stream with the wire's error event, and let
        # the cooling policy count the account's fault all the same.
        if ctx is not None:
            ctx.report_upstream(BROKEN_STREAM_STATUS)
        message = f"upstream stream failed: {type(exc).__name__}"
        yield stream_error_event(wire, "upstream_error", message, sequence)
        return
    finally:
        if ctx is not None:
            report_tokens(ctx, usage.end())  # what the stream said of its usage, however it ended
    if pending:  # the upstream ended mid-event itself: pass on what it sent
        yield pending if namer is None else namer.feed(pending) + namer.end()


def events_end(data: bytes) -> int:
    """Length of the prefix of `data` that holds only whole SSE events."""
    end = data.rfind(b"\n\n")
    if end >= 0:
        return end + 2
    end = data.rfind(b"\r\n\r\n")
    return end + 4 if end >= 0 else 0


async def _body(answer: httpx.Response) -> AsyncGenerator[bytes, None]:
    try:
        with map_exceptions():  # httpx's own errors too, from a client not make_http_client()'s
            async for chunk in answer.aiter_bytes():
                yield chunk
    finally:
        await answer.aclose()


def _wire_of(answer: httpx.Response) -> Wire:
    """The wire of the upstream's path (an account's path template ends as the API's does)."""
    path = answer.request.url.path
    for suffix, wire in WIRE_PATHS.items():
        if path.endswith(suffix.removeprefix("/v1")):
            return wire
    return Wire.GENERIC
