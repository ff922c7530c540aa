"""What Envoy lets an upstream-level ext_proc filter do with a stream's response headers, as
docs/envoy.md says (a stream starts at its first content event): measured with a bare
processor, not switchyard's, so that the facts hold whatever the processor does with them.

The provider sends its headers and opening event at once and its first content event after
`LATE_SECS` on the first attempt, at once on the second. The processor holds its answer to
the response headers: released when a body piece shows content, else after `HOLD_SECS` with
`x-switchyard-retry: 1`, which the route's retry policy retries on.

- `FULL_DUPLEX_STREAMED`: the body's pieces reach the processor while its answer to the
  headers is pending, so the hold can end at the first content event; the retry asked for
  late is taken, and the client gets only the second attempt's bytes, well before the first
  attempt's content was due. Body answers must follow the headers' answer (one sent before it
  is a "spurious response", and Envoy answers 500).
- `STREAMED`: no piece of the body reaches the processor before it answers the headers: a
  hold can only end by its timer, so every stream would wait the whole limit.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from envoy_rig import bare_processor, ext_proc_filter, probe_config, upstream_cluster
from servers import free_port
from switchyard_mw._protos.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from switchyard_mw._protos.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from switchyard_mw.engine.content_events import ContentWatch
from switchyard_mw.testing.envoy import envoy_binary, run_on_free_ports
from switchyard_mw.wire import Wire

pytestmark = pytest.mark.integration

LATE_SECS = 5.0
HOLD_SECS = 0.5
OPENING = b'event: message_start\ndata: {"type":"message_start"}\n\n'
CONTENT = (
    b'event: content_block_delta\ndata: {"type":"content_block_delta",'
    b'"delta":{"type":"text_delta","text":"attempt %d"}}\n\n'
)


class Upstream:
    """A provider whose first attempt's first content event comes `LATE_SECS` late."""

    def __init__(self) -> None:
        self.port = free_port()
        self.hits = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        self.hits += 1
        attempt = self.hits

        def chunk(data: bytes) -> bytes:
            return f"{len(data):x}\r\n".encode() + data + b"\r\n"

        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n" + chunk(OPENING)
        )
        await writer.drain()
        try:
            if attempt == 1:
                await asyncio.sleep(LATE_SECS)
            writer.write(chunk(CONTENT % attempt) + b"0\r\n\r\n")
            await writer.drain()
        except (asyncio.CancelledError, ConnectionError):
            pass
        finally:
            writer.close()


class HoldingProcessor(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """Holds its answer to the response headers until content, or asks for a retry."""

    def __init__(self, duplex: bool) -> None:
        self.duplex = duplex
        self.log: list[tuple[float, str]] = []

    async def Process(self, requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        out: asyncio.Queue[Any] = asyncio.Queue()
        held: dict[str, Any] = {"headers": False, "bodies": []}
        watch = ContentWatch(Wire.ANTHROPIC)
        timers: list[asyncio.Future[None]] = []

        async def release(retry: bool) -> None:
            if not held["headers"]:
                return
            held["headers"] = False
            answer = ep.ProcessingResponse()
            answer.response_headers.SetInParent()
            if retry:
                option = answer.response_headers.response.header_mutation.set_headers.add()
                option.header.key, option.header.raw_value = "x-switchyard-retry", b"1"
            self.log.append((time.monotonic(), "retry" if retry else "released"))
            await out.put(answer)
            for body in held["bodies"]:
                await out.put(body)
            held["bodies"] = []

        async def expire() -> None:
            await asyncio.sleep(HOLD_SECS)
            await release(True)

        async def read() -> None:
            async for request in requests:
                kind = request.WhichOneof("request")
                if kind == "response_headers":
                    held["headers"] = True
                    self.log.append((time.monotonic(), "headers"))
                    timers.append(asyncio.ensure_future(expire()))
                elif kind == "response_body":
                    piece = request.response_body
                    self.log.append((time.monotonic(), f"body while held={held['headers']}"))
                    answer = ep.ProcessingResponse()
                    if self.duplex:
                        streamed = answer.response_body.response.body_mutation.streamed_response
                        streamed.body, streamed.end_of_stream = piece.body, piece.end_of_stream
                    else:
                        answer.response_body.SetInParent()
                    content = watch.feed(piece.body)
                    if held["headers"]:
                        held["bodies"].append(answer)
                        if content:
                            await release(False)
                    else:
                        await out.put(answer)
                else:
                    answer = ep.ProcessingResponse()
                    getattr(answer, kind).SetInParent()
                    await out.put(answer)
            await out.put(None)

        task = asyncio.ensure_future(read())
        while (item := await out.get()) is not None:
            yield item
        await task


RETRIED_ON_ASKING = {
    "cluster": "provider",
    "timeout": "30s",
    "retry_policy": {
        "retry_on": "retriable-headers",
        "num_retries": 1,
        "retriable_headers": [{"name": "x-switchyard-retry", "string_match": {"exact": "1"}}],
    },
}


def config(mode: str) -> str:
    """The provider's cluster with the processor's upstream filter, its response body `mode`."""
    processing = {
        "request_header_mode": "SKIP",
        "request_body_mode": "NONE",
        "response_header_mode": "SEND",
        "response_body_mode": mode,
        "request_trailer_mode": "SKIP",
        "response_trailer_mode": "SEND" if mode == "FULL_DUPLEX_STREAMED" else "SKIP",
    }
    provider = upstream_cluster("provider", filters=[ext_proc_filter(processing)])
    return probe_config(RETRIED_ON_ASKING, provider)


async def _probe(mode: str) -> tuple[int, bytes, float, Upstream, HoldingProcessor]:
    envoy_binary()  # raises, saying what to install, when there is no Envoy
    upstream, processor = Upstream(), HoldingProcessor(mode == "FULL_DUPLEX_STREAMED")
    provider = await asyncio.start_server(upstream.handle, "127.0.0.1", upstream.port)
    try:
        async with bare_processor(processor) as port:
            with run_on_free_ports(config(mode), processor=port, upstream=upstream.port) as envoy:
                async with httpx.AsyncClient(timeout=20) as client:
                    started = time.monotonic()
                    reply = await client.post(f"{envoy.url}/v1/messages", content=b"{}")
                    took = time.monotonic() - started
    finally:
        provider.close()
    return reply.status_code, reply.content, took, upstream, processor


async def test_full_duplex_lets_the_headers_wait_for_the_first_content_event() -> None:
    status, body, took, upstream, processor = await _probe("FULL_DUPLEX_STREAMED")
    assert status == 200
    assert body == OPENING + CONTENT % 2  # the second attempt's stream, nothing of the first
    assert upstream.hits == 2
    assert took < LATE_SECS / 2  # well before the first attempt's content was due
    events = [event for _, event in processor.log]
    # The first attempt's opening reached the processor while its headers were held.
    assert events[:3] == ["headers", "body while held=True", "retry"]
    assert "released" in events[3:]


async def test_streamed_sends_no_body_before_the_headers_are_answered() -> None:
    status, _, took, upstream, processor = await _probe("STREAMED")
    events = [event for _, event in processor.log]
    # Every hold ended by its timer: no body piece came while the headers waited.
    assert "body while held=True" not in events
    assert "released" not in events
    assert events.count("retry") == 2
    assert took >= 2 * HOLD_SECS  # each attempt waited the whole limit
    assert status == 200
    assert upstream.hits == 2
