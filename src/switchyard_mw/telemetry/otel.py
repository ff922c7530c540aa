"""`configure()`: OpenTelemetry for an app that has not set it up, the standard way, in one call.

    from switchyard_mw.telemetry import otel
    otel.configure(service_name="llm-gateway")   # before serving the first request

What it installs, each only when the application has not installed its own provider (it never
replaces one: the application's setup always wins):

- traces: an SDK tracer provider exporting over OTLP (batched), when an OTLP endpoint is set
  (`OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) and
  `OTEL_TRACES_EXPORTER` is not `none`. Without an endpoint no tracer provider is installed,
  so every span stays the API's no-op and costs next to nothing.
- metrics: an SDK meter provider with a Prometheus reader (when the `prometheus` extra is
  installed; `prometheus.render()` then serves the text) and an OTLP exporter when an endpoint
  is set (`..._METRICS_ENDPOINT` too) and `OTEL_METRICS_EXPORTER` is not `none`.

Everything else comes from the standard variables, read by the SDK and the exporters:
`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_EXPORTER_OTLP_PROTOCOL`
(`http/protobuf`, the default, or `grpc`), `OTEL_EXPORTER_OTLP_HEADERS`, `..._TIMEOUT`,
`..._COMPRESSION`, `OTEL_TRACES_SAMPLER`, `OTEL_BSP_*`, `OTEL_METRIC_EXPORT_INTERVAL`, and
`OTEL_SDK_DISABLED=true` to install nothing. The OTLP exporters need the `otlp` extra
(`opentelemetry-exporter-otlp-proto-http`; `grpc` needs `opentelemetry-exporter-otlp-proto-grpc`).

Calling it again does nothing more and returns what the first call installed.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from opentelemetry import metrics, trace
from opentelemetry.metrics._internal import _ProxyMeterProvider

from ..errors import StartupError, install_hint

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace.export import SpanExporter

__all__ = ["Setup", "configure"]


@dataclass(frozen=True, slots=True)
class Setup:
    """What `configure()` found or installed.

    `traces`: "otlp" (installed), "existing" (the application's provider, left alone) or "off".
    `metrics`: the readers installed ("prometheus", "otlp"), or ("existing",), or () for none.
    """

    traces: str
    metrics: tuple[str, ...]


_lock = threading.Lock()
_setup: Setup | None = None


def configure(*, service_name: str | None = None, prometheus: bool = True) -> Setup:
    """Install tracer and meter providers as the environment asks, unless already installed.

    `service_name` is the default `service.name`; `OTEL_SERVICE_NAME` (or `service.name` in
    `OTEL_RESOURCE_ATTRIBUTES`) overrides it. `prometheus=False` leaves out the Prometheus
    reader. Idempotent and thread-safe. Raises `StartupError` when the environment asks for an
    exporter that is not installed or a protocol that does not exist, rather than running
    without the telemetry it was configured to send.
    """
    global _setup
    with _lock:
        if _setup is None:
            _setup = _configure(os.environ, service_name=service_name, prometheus=prometheus)
        return _setup


def _configure(env: Mapping[str, str], *, service_name: str | None, prometheus: bool) -> Setup:
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return Setup(traces="off", metrics=())
    if importlib.util.find_spec("opentelemetry.sdk") is None:
        # The middlewares alone: the API's no-ops. An endpoint set means telemetry was asked
        # for, and running without it silently is what this function refuses to do.
        if _exports(env, "TRACES") or _exports(env, "METRICS"):
            raise StartupError(
                "an OTLP endpoint is set but the OpenTelemetry SDK is not installed: "
                + install_hint("otlp")
            )
        return Setup(traces="off", metrics=())
    resource = _resource(env, service_name)
    return Setup(traces=_traces(env, resource), metrics=_metrics(env, resource, prometheus))


def _resource(env: Mapping[str, str], service_name: str | None) -> Resource:
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource

    attributes = {}
    # Code gives the default; the operator's environment decides.
    listed = env.get("OTEL_RESOURCE_ATTRIBUTES", "").split(",")
    named_by_env = "OTEL_SERVICE_NAME" in env or any(
        item.partition("=")[0].strip() == SERVICE_NAME for item in listed
    )
    if service_name and not named_by_env:
        attributes[SERVICE_NAME] = service_name
    return Resource.create(attributes)


def _traces(env: Mapping[str, str], resource: Resource) -> str:
    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return "existing"
    if not _exports(env, "TRACES"):
        return "off"
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=resource)  # sampler from OTEL_TRACES_SAMPLER
    provider.add_span_processor(BatchSpanProcessor(_span_exporter(env)))
    trace.set_tracer_provider(provider)
    return "otlp"


def _metrics(env: Mapping[str, str], resource: Resource, prometheus: bool) -> tuple[str, ...]:
    # Until a provider is set the API hands out its proxy; only `trace` exports that class.
    if not isinstance(metrics.get_meter_provider(), _ProxyMeterProvider):
        return ("existing",)
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    readers: list[MetricReader] = []
    names: list[str] = []
    if prometheus:
        try:
            from opentelemetry.exporter.prometheus import PrometheusMetricReader
        except ImportError:
            pass  # the `prometheus` extra is optional: OTLP alone is a complete setup
        else:
            readers.append(PrometheusMetricReader())
            names.append("prometheus")
    if _exports(env, "METRICS"):
        readers.append(PeriodicExportingMetricReader(_metric_exporter(env)))
        names.append("otlp")
    if readers:
        from . import request_metrics

        for reader in readers:
            request_metrics.bridge(reader)  # duration, first token, usage: tallied, not SDK
        metrics.set_meter_provider(MeterProvider(resource=resource, metric_readers=readers))
    return tuple(names)


def _exports(env: Mapping[str, str], signal: str) -> bool:
    """Whether `signal` ("TRACES", "METRICS") goes out over OTLP, as the variables say."""
    exporter = env.get(f"OTEL_{signal}_EXPORTER", "otlp").strip().lower()
    if exporter == "none":
        return False
    if exporter != "otlp":
        raise StartupError(f"OTEL_{signal}_EXPORTER={exporter!r}: only 'otlp' or 'none'")
    return bool(
        env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT")
    )


def _protocol(env: Mapping[str, str], signal: str) -> str:
    protocol = (
        env.get(f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL")
        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    if protocol not in ("http/protobuf", "grpc"):
        raise StartupError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: use 'http/protobuf' or 'grpc'"
        )
    return protocol


def _span_exporter(env: Mapping[str, str]) -> SpanExporter:
    # The exporters read their endpoint, headers, timeout and compression from the environment.
    try:
        if _protocol(env, "TRACES") == "grpc":
            grpc = importlib.import_module("opentelemetry.exporter.otlp.proto.grpc.trace_exporter")
            exporter: SpanExporter = grpc.OTLPSpanExporter()
            return exporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    except ImportError as exc:
        raise _missing(exc) from None


def _metric_exporter(env: Mapping[str, str]) -> MetricExporter:
    try:
        if _protocol(env, "METRICS") == "grpc":
            grpc = importlib.import_module("opentelemetry.exporter.otlp.proto.grpc.metric_exporter")
            exporter: MetricExporter = grpc.OTLPMetricExporter()
            return exporter
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

        return OTLPMetricExporter()
    except ImportError as exc:
        raise _missing(exc) from None


def _missing(exc: ImportError) -> StartupError:
    return StartupError(
        f"an OTLP endpoint is set but its exporter is not installed ({exc.name}): "
        f"{install_hint('otlp')} (for grpc: opentelemetry-exporter-otlp-proto-grpc)"
    )
