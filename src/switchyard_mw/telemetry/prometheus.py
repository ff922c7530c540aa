"""Prometheus text exposition of switchyard's metrics (needs the `prometheus` extra).

`install()` points OpenTelemetry's global meter provider at a Prometheus reader, unless an SDK
provider is already set (then that one's export wins); `metrics_app` serves the text.
"""

from __future__ import annotations

from opentelemetry import metrics
from starlette.types import Receive, Scope, Send

from ..errors import install_hint


def install() -> bool:
    """Install a Prometheus-backed meter provider; False if one could not be installed."""
    try:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from opentelemetry.sdk.metrics import MeterProvider
    except ImportError:
        return False
    if isinstance(metrics.get_meter_provider(), MeterProvider):
        return True  # the application configured OpenTelemetry itself
    from .request_metrics import bridge

    reader = bridge(PrometheusMetricReader())  # with the request metrics (see request_metrics)
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    return True


def render() -> tuple[int, bytes, str]:
    """(status, body, content type) of the Prometheus text exposition."""
    try:
        from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
    except ImportError:
        return (
            501,
            f"needs the 'prometheus' extra: {install_hint('prometheus')}\n".encode(),
            "text/plain",
        )
    return 200, generate_latest(REGISTRY), CONTENT_TYPE_LATEST


async def metrics_app(scope: Scope, receive: Receive, send: Send) -> None:
    """ASGI endpoint answering the registry in Prometheus text format."""
    status, body, ctype = render()
    headers = [(b"content-type", ctype.encode()), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
