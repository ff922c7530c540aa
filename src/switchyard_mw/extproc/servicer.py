"""The `ExternalProcessor` servicer: one ext_proc stream in, one phase answer out.

`open` and `end` are the stream's life in either transport: grpc.aio calls them from `Process`,
the `h2` transport (`h2_transport`) from its own stream handling.

Which filter opened the stream is read from its gRPC initial metadata (`x-switchyard-filter:
upstream` for the filter in a cluster's upstream chain, `first_token` and `cloud` for the
first-token filter and a Bedrock or Vertex cluster's cloud filter; anything else is the
router-level filter). When a tracer SDK is installed, the trace context Envoy sends in the metadata
(`traceparent`) parents the request's spans, so they join Envoy's trace; without one, no span
is made and the metadata is not parsed for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable

import grpc  # type: ignore[import-untyped]  # grpcio ships no type hints
from opentelemetry import context as otel_context
from opentelemetry import propagate

from .._protos.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from .._protos.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from ..telemetry import names as tm
from .cloud import CLOUD_FILTER, CloudStream
from .first_token import FIRST_TOKEN_FILTER, FirstTokenStream
from .flights import Flights
from .policy import Policies
from .router import RouterStream
from .upstream import FILTER_METADATA, HEDGED_FILTER, UpstreamStream


class ExtProcServicer(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """Serves both filter levels from one `Policies` (and so one account pool)."""

    def __init__(self, policies: Policies, flights: Flights | None = None) -> None:
        self.policies = policies
        self.flights = flights if flights is not None else Flights()

    async def Process(
        self,
        request_iterator: AsyncIterator[ep.ProcessingRequest],
        context: grpc.aio.ServicerContext[ep.ProcessingRequest, ep.ProcessingResponse],
    ) -> AsyncIterator[ep.ProcessingResponse]:
        stream = self.open(context.invocation_metadata() or ())
        try:
            if isinstance(stream, FirstTokenStream):
                async for answer in _pushed(stream, request_iterator):
                    yield answer
                return
            async for request in request_iterator:
                answer = stream.answer(request)
                if not isinstance(answer, ep.ProcessingResponse):
                    answer = await answer  # it takes waiting (`h2_stream.Handler`)
                yield answer
        finally:
            self.end(stream)

    def open(self, metadata: Iterable[tuple[str, str | bytes]]) -> Stream:
        """The state of a new stream, for the filter level its metadata names."""
        metadata = list(metadata)
        for key, value in metadata:
            if key != FILTER_METADATA:
                continue
            if value in ("upstream", b"upstream"):
                return UpstreamStream(self.policies, self.flights)
            if value in (HEDGED_FILTER, HEDGED_FILTER.encode()):
                return UpstreamStream(self.policies, self.flights, observes=True)
            if value in (FIRST_TOKEN_FILTER, FIRST_TOKEN_FILTER.encode()):
                return FirstTokenStream(self.flights)
            if value in (CLOUD_FILTER, CLOUD_FILTER.encode()):
                return CloudStream(self.flights)
        return RouterStream(self.policies, self.flights, _trace_parent(metadata))

    @staticmethod
    def end(stream: object) -> None:
        """However the stream ended: a router-level stream's telemetry ends with it, a
        first-token stream's timer stops."""
        if isinstance(stream, RouterStream | FirstTokenStream):
            stream.close()


Stream = RouterStream | UpstreamStream | FirstTokenStream | CloudStream


async def _pushed(
    stream: FirstTokenStream, requests: AsyncIterator[ep.ProcessingRequest]
) -> AsyncIterator[ep.ProcessingResponse]:
    """A stream whose answers are not one per message: a reader of its own takes the
    messages while an answer is held, and the answers go out as the stream emits them."""
    out: asyncio.Queue[ep.ProcessingResponse | None] = asyncio.Queue()
    stream.attach(out.put_nowait)

    async def read() -> None:
        try:
            async for request in requests:
                answer = stream.answer(request)  # at once, always (`FirstTokenStream`)
                if answer is not None:
                    out.put_nowait(answer)
        finally:
            out.put_nowait(None)

    reader = asyncio.ensure_future(read())
    try:
        while (answer := await out.get()) is not None:
            yield answer
        await reader  # its error, if any, ends the call
    finally:
        reader.cancel()


def _trace_parent(metadata: Iterable[tuple[str, str | bytes]]) -> otel_context.Context | None:
    """The trace context Envoy sent, when spans are worth making (a tracer SDK is installed)."""
    if not tm.tracing():
        return None
    carrier = {k: v if isinstance(v, str) else v.decode("latin-1") for k, v in metadata}
    return propagate.extract(carrier)
