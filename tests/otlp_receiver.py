"""A real OTLP/HTTP (protobuf) receiver for tests: what a collector would get, kept in memory.

Built on `opentelemetry-proto` and the standard library's HTTP server, on its own thread, so a
gateway in another process exports to it exactly as it would to a collector.
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar

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

T = TypeVar("T")


@dataclass(frozen=True)
class ReceivedSpan:
    span: Span
    resource: dict[str, Any]

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


def value_of(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [value_of(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


def attributes_of(pairs: Any) -> dict[str, Any]:
    return {kv.key: value_of(kv.value) for kv in pairs if isinstance(kv, KeyValue)}


class OtlpReceiver:
    """`with OtlpReceiver() as otlp:` listens on `otlp.endpoint` until the block ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.raw: list[tuple[str, bytes]] = []
        """Every export request body (decompressed), with its path: what a scan must cover."""
        self.requests: list[tuple[str, Any]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                if self.headers.get("content-encoding", "") == "gzip":
                    body = gzip.decompress(body)
                service = _SERVICES.get(self.path)
                if service is None:
                    self.send_error(404)
                    return
                request_type, response_type = service
                message = request_type.FromString(body)
                with receiver._lock:
                    receiver.raw.append((self.path, body))
                    receiver.requests.append((self.path, message))
                reply = response_type().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # quiet: the test reads what arrived, not an access log

        return Handler

    def _of(self, path: str) -> list[Any]:
        with self._lock:
            return [message for p, message in self.requests if p == path]

    def spans(self) -> list[ReceivedSpan]:
        out = []
        for request in self._of("/v1/traces"):
            for resource_spans in request.resource_spans:
                resource = attributes_of(resource_spans.resource.attributes)
                for scope_spans in resource_spans.scope_spans:
                    out.extend(ReceivedSpan(s, resource) for s in scope_spans.spans)
        return out

    def metric_points(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """(metric name, data point attributes) of every point received."""
        for request in self._of("/v1/metrics"):
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
