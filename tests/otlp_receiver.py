"""A real OTLP receiver for tests: what a collector would get, kept in memory.

OTLP/HTTP (protobuf) always, on the standard library's HTTP server; OTLP/gRPC too with
`OtlpReceiver(grpc=True)` (Envoy's OpenTelemetry tracer exports over gRPC), on a grpcio server.
Both run on their own threads, so a gateway in another process, or Envoy, exports to it exactly
as it would to a collector; what arrives by either transport is read the same way.
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar

import grpc  # type: ignore[import-untyped]  # grpcio ships no type hints
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

_SERVICES: dict[str, tuple[Any, Any]] = {
    "/v1/traces": (
        trace_service_pb2.ExportTraceServiceRequest,
        trace_service_pb2.ExportTraceServiceResponse,
    ),
    "/v1/metrics": (
        metrics_service_pb2.ExportMetricsServiceRequest,
        metrics_service_pb2.ExportMetricsServiceResponse,
    ),
    "/v1/logs": (
        logs_service_pb2.ExportLogsServiceRequest,
        logs_service_pb2.ExportLogsServiceResponse,
    ),
}

_GRPC_SERVICES = {
    "/v1/traces": "opentelemetry.proto.collector.trace.v1.TraceService",
    "/v1/metrics": "opentelemetry.proto.collector.metrics.v1.MetricsService",
    "/v1/logs": "opentelemetry.proto.collector.logs.v1.LogsService",
}
"""The gRPC service (method `Export`) of each OTLP/HTTP path: what a request is filed under."""

T = TypeVar("T")


@dataclass(frozen=True)
class ReceivedSpan:
    span: Span
    resource: dict[str, Any]
    transport: str = "http"
    """How it arrived: "http" (OTLP/HTTP) or "grpc" (OTLP/gRPC)."""

    @property
    def name(self) -> str:
        return self.span.name

    @property
    def trace_id(self) -> str:
        return self.span.trace_id.hex()

    @property
    def span_id(self) -> str:
        return self.span.span_id.hex()

    @property
    def parent_id(self) -> str:
        return self.span.parent_span_id.hex()

    @property
    def attributes(self) -> dict[str, Any]:
        return attributes_of(self.span.attributes)

    @property
    def service(self) -> Any:
        """The exporter's `service.name` resource attribute."""
        return self.resource.get("service.name")


def value_of(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [value_of(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


def attributes_of(pairs: Any) -> dict[str, Any]:
    return {kv.key: value_of(kv.value) for kv in pairs if isinstance(kv, KeyValue)}


class OtlpReceiver:
    """`with OtlpReceiver() as otlp:` listens on `otlp.endpoint` until the block ends.

    With `grpc=True` it also takes OTLP/gRPC on 127.0.0.1:`otlp.grpc_port` (plaintext HTTP/2).
    """

    _grpc: grpc.Server | None

    def __init__(self, *, grpc: bool = False) -> None:
        self._lock = threading.Lock()
        self.raw: list[tuple[str, bytes]] = []
        """Every export request body (decompressed), with its path: what a scan must cover."""
        self.requests: list[tuple[str, Any]] = []
        """Every export request, parsed, with its OTLP/HTTP path (gRPC ones filed the same)."""
        self._transports: list[str] = []  # of each entry of `requests`
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._grpc_port = 0
        self._grpc = self._grpc_server() if grpc else None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    @property
    def grpc_port(self) -> int:
        if self._grpc is None:
            raise RuntimeError("OtlpReceiver(grpc=True) takes OTLP/gRPC; this one does not")
        return self._grpc_port

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        if self._grpc is not None:
            self._grpc.start()
        return self

    def __exit__(self, *_: object) -> None:
        if self._grpc is not None:
            self._grpc.stop(grace=None)
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def _record(self, transport: str, path: str, body: bytes) -> bytes:
        """File one export request; the serialized (empty) success response to send back."""
        request_type, response_type = _SERVICES[path]
        message = request_type.FromString(body)
        with self._lock:
            self.raw.append((path, body))
            self.requests.append((path, message))
            self._transports.append(transport)
        reply: bytes = response_type().SerializeToString()
        return reply

    def _grpc_server(self) -> grpc.Server:
        server = grpc.server(ThreadPoolExecutor(max_workers=4, thread_name_prefix="otlp-grpc"))
        for path, service in _GRPC_SERVICES.items():

            def export(body: bytes, _: grpc.ServicerContext, path: str = path) -> bytes:
                return self._record("grpc", path, body)

            # No (de)serializers: the handler gets and returns raw bytes, kept as they came.
            handler = grpc.unary_unary_rpc_method_handler(export)
            server.add_generic_rpc_handlers(
                (grpc.method_handlers_generic_handler(service, {"Export": handler}),)
            )
        self._grpc_port = server.add_insecure_port("127.0.0.1:0")
        return server

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self._body()
                if self.headers.get("content-encoding", "") == "gzip":
                    body = gzip.decompress(body)
                if self.path not in _SERVICES:
                    self.send_error(404)
                    return
                reply = receiver._record("http", self.path, body)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def _body(self) -> bytes:
                if "chunked" not in self.headers.get("transfer-encoding", "").lower():
                    return self.rfile.read(int(self.headers.get("content-length", "0")))
                # Envoy's OTLP/HTTP exporter (http_service) sends its body chunked.
                chunks = []
                while size := int(self.rfile.readline().split(b";")[0], 16):
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return b"".join(chunks)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # quiet: the test reads what arrived, not an access log

        return Handler

    def _of(self, path: str) -> list[tuple[str, Any]]:
        """(transport, message) of every request received on `path`."""
        with self._lock:
            pairs = zip(self._transports, self.requests, strict=True)
            return [(transport, message) for transport, (p, message) in pairs if p == path]

    def spans(self) -> list[ReceivedSpan]:
        out: list[ReceivedSpan] = []
        for transport, request in self._of("/v1/traces"):
            for resource_spans in request.resource_spans:
                resource = attributes_of(resource_spans.resource.attributes)
                for scope_spans in resource_spans.scope_spans:
                    out.extend(ReceivedSpan(s, resource, transport) for s in scope_spans.spans)
        return out

    def metric_points(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """(metric name, data point attributes) of every point received."""
        for _, request in self._of("/v1/metrics"):
            for resource_metrics in request.resource_metrics:
                for scope_metrics in resource_metrics.scope_metrics:
                    for metric in scope_metrics.metrics:
                        kind = metric.WhichOneof("data")
                        for point in getattr(metric, kind).data_points:
                            yield metric.name, attributes_of(point.attributes)

    def wait_for(self, probe: Callable[[OtlpReceiver], T | None], timeout: float = 15.0) -> T:
        """Poll until `probe(self)` returns something truthy; exports arrive in batches."""
        end = time.monotonic() + timeout
        while True:
            found = probe(self)
            if found:
                return found
            if time.monotonic() > end:
                raise AssertionError(f"not received within {timeout} s")
            time.sleep(0.05)
