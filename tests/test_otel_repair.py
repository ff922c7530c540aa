"""A clobbered opentelemetry-proto (xds-protos installed after it) is named, with its repair."""

from __future__ import annotations

from switchyard_mw.otel import _missing


def test_a_clobbered_proto_names_the_repair() -> None:
    exc = ImportError(
        "cannot import name 'InstrumentationScope' from 'opentelemetry.proto.common.v1.common_pb2'",
        name="opentelemetry.proto.common.v1.common_pb2",
    )
    message = str(_missing(exc))
    assert "xds-protos" in message
    assert "pip install --force-reinstall --no-deps opentelemetry-proto" in message


def test_a_missing_exporter_names_the_extra() -> None:
    exc = ImportError(
        "No module named 'opentelemetry.exporter.otlp'", name="opentelemetry.exporter.otlp"
    )
    assert "switchyard-mw[otlp]" in str(_missing(exc))
