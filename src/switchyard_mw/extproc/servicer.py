"""The grpc.aio `ExternalProcessor` servicer: one ext_proc stream in, one phase answer out.

Which filter opened the stream is read from its gRPC initial metadata (`x-switchyard-filter:
upstream` for the filter in a cluster's upstream chain; anything else is the router-level
filter). The trace context Envoy sends in the metadata (`traceparent`) parents the request's
spans, so they join Envoy's trace.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc  # type: ignore[import-untyped]  # grpcio ships no type hints
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from opentelemetry import propagate

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
        metadata = {
            key: value if isinstance(value, str) else value.decode("latin-1")
            for key, value in (context.invocation_metadata() or ())
        }
        stream: RouterStream | UpstreamStream
        if metadata.get(FILTER_METADATA) == "upstream":
            stream = UpstreamStream(self.policies, self.flights)
        else:
            # A cancelled stream is Envoy hanging up: the downstream client left (or the
            # server stopped past its grace period), which the judge counts as `disconnect`.
            parent = propagate.extract(metadata)
            stream = RouterStream(self.policies, self.flights, parent, gone=lambda: True)
        try:
            async for request in request_iterator:
                yield await stream.on(request)
        finally:
            if isinstance(stream, RouterStream):
                stream.close()
