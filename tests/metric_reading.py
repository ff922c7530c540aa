"""Reading the session's in-memory metrics (tests/conftest.py's pipeline): `Metrics`, which
test modules import as `from conftest import Metrics` (each conftest re-exports it)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from opentelemetry.sdk.metrics.export import InMemoryMetricReader


def _amount(point: Any) -> float:
    """A counter's value, a histogram's count."""
    amount: float = getattr(point, "value", None) or getattr(point, "count", 0)
    return amount


class Metrics:
    """Reads the current value of a counter or histogram count for given attributes."""

    def __init__(self, reader: InMemoryMetricReader) -> None:
        self._reader = reader

    def _points(self, name: str | None = None) -> Iterator[tuple[str, Any]]:
        """(metric name, data point) of every point so far; `name`: of that metric only."""
        data = self._reader.get_metrics_data()
        for rm in data.resource_metrics if data is not None else ():
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    if name is not None and metric.name != name:
                        continue
                    for point in metric.data.data_points:
                        yield metric.name, point

    def value(self, name: str, **attributes: str) -> float:
        total = 0.0
        for _, point in self._points(name):
            attrs = dict(point.attributes or {})
            if all(attrs.get(k) == v for k, v in attributes.items()):
                total += _amount(point)
        return total

    def histogram(self, name: str, **attributes: str) -> tuple[list[float], list[int]]:
        """(bucket bounds, bucket counts) of a histogram's data point with these attributes.

        Counts are cumulative over the session; ([], []) before anything was recorded.
        """
        for _, point in self._points(name):
            if dict(point.attributes or {}) == attributes:
                return list(point.explicit_bounds), list(point.bucket_counts)
        return [], []

    def points(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """(metric name, attributes) of every data point recorded so far."""
        for name, point in self._points():
            yield name, dict(point.attributes or {})

    def series(self, name: str) -> dict[tuple[tuple[str, Any], ...], float]:
        """Each data point of counter or histogram `name` so far, by its attributes (sorted
        pairs): the counter's value, the histogram's count."""
        found: dict[tuple[tuple[str, Any], ...], float] = {}
        for _, point in self._points(name):
            key = tuple(sorted((point.attributes or {}).items()))
            found[key] = found.get(key, 0.0) + _amount(point)
        return found
