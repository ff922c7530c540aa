"""The `ExternalProcessor` servicer: one ext_proc stream in, one phase answer out.

`open` and `end` are the stream's life in either transport: grpc.aio calls them from `Process`,
the `h2` transport (`h2_transport`) from its own stream handling.

Which filter opened the stream is read from its gRPC initial metadata (`x-switchyard-filter:
upstream` for the filter in a cluster's upstream chain; anything else is the router-level
filter). When a tracer SDK is installed, the trace context Envoy sends in the metadata
(`traceparent`) parents the request's spans, so they join Envoy's trace; without one, no span
is made and the metadata is not parsed for it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable

import grpc  # type: ignore[import-untyped]  # grpcio ships no type hints
from opentelemetry import context as otel_context
from opentelemetry import propagate

from .._protos.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from .._protos.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from ..telemetry import names as tm
from .flights import Flights
from .policy import Policies
from .router import RouterStream
from .upstream import FILTER_METADATA, UpstreamStream


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
            async for request in request_iterator:
                yield await stream.on(request)
        finally:
            self.end(stream)

    def open(self, metadata: Iterable[tuple[str, str | bytes]]) -> RouterStream | UpstreamStream:
        """The state of a new stream, for the filter level its metadata names."""
        metadata = list(metadata)
        if any(k == FILTER_METADATA and v in ("upstream", b"upstream") for k, v in metadata):
            return UpstreamStream(self.policies, self.flights)
        return RouterStream(self.policies, self.flights, _trace_parent(metadata))

    @staticmethod
    def end(stream: object) -> None:
        """However the stream ended: a router-level stream's telemetry ends with it."""
        if isinstance(stream, RouterStream):
            stream.close()


def _trace_parent(metadata: Iterable[tuple[str, str | bytes]]) -> otel_context.Context | None:
    """The trace context Envoy sent, when spans are worth making (a tracer SDK is installed)."""
    if not tm.tracing():
        return None
    carrier = {k: v if isinstance(v, str) else v.decode("latin-1") for k, v in metadata}
    return propagate.extract(carrier)
