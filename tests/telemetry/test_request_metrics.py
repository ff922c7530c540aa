"""Request metrics: duration, time to first token and token usage, labelled for dashboards."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from conftest import Metrics
from switchyard_mw.asgi.stack import switchyard_stack
from switchyard_mw.config import parse_config
from switchyard_mw.context import current_context
from switchyard_mw.telemetry import names as tm
from switchyard_mw.telemetry import request_metrics as rm

CONFIG = """
[llm_clients.acct-a]
base_url = "http://a.test"
models = ["rm-base", "rm-variant", "rm-other"]

[canaries.rm-base]
variants = { rm-variant = 100.0 }
"""
TURN = [{"role": "user", "content": "hello"}]


async def upstream_app(request: Request) -> Response:
    """The app behind the stack: answers as the scripted status says, reports usage."""
    body = await request.json()
    ctx = current_context()
    assert ctx is not None
    if body.get("stream"):

        async def events() -> Any:
            yield b'event: message_start\ndata: {"type":"message_start"}\n\n'
            yield b'event: content_block_delta\ndata: {"type":"content_block_delta"}\n\n'
            yield b'event: message_stop\ndata: {"type":"message_stop"}\n\n'

        ctx.report_usage(input_tokens=11, output_tokens=2)
        return StreamingResponse(events(), media_type="text/event-stream")
    status = int(request.headers.get("x-test-status", "200"))
    if status == 200:
        ctx.report_usage(input_tokens=300, output_tokens=40)
    return JSONResponse({"model": body["model"]}, status_code=status)


def stack() -> Any:
    app = Starlette(routes=[Route("/v1/messages", upstream_app, methods=["POST"])])
    return switchyard_stack(app, config=parse_config(CONFIG), environ={})


def labels(**kwargs: str) -> dict[str, str]:
    names = {
        "requested": tm.REQUEST_MODEL,
        "routed": tm.RESPONSE_MODEL,
        "variant": tm.VARIANT,
        "account": tm.ACCOUNT,
        "error": tm.ERROR_TYPE,
        "tokens": tm.TOKEN_TYPE,
    }
    return {names[k]: v for k, v in kwargs.items()}


async def post(body: dict[str, Any], **headers: str) -> httpx.Response:
    transport = httpx.ASGITransport(app=stack())
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        return await client.post("/v1/messages", json=body, headers=headers)


async def test_a_200_is_counted_with_its_models_variant_and_account(
    otel_metrics: Metrics,
) -> None:
    want = labels(requested="rm-base", routed="rm-variant", variant="rm-variant", account="acct-a")
    before = otel_metrics.value(tm.OPERATION_DURATION, **want)
    inputs = otel_metrics.value(tm.TOKEN_USAGE, **want, **labels(tokens="input"))
    response = await post({"model": "rm-base", "max_tokens": 5, "messages": TURN})
    assert response.status_code == 200
    assert otel_metrics.value(tm.OPERATION_DURATION, **want) == before + 1
    assert otel_metrics.value(tm.TOKEN_USAGE, **want, **labels(tokens="input")) == inputs + 1
    points = [
        (name, attrs)
        for name, attrs in otel_metrics.points()
        if name == tm.OPERATION_DURATION and attrs.get(tm.REQUEST_MODEL) == "rm-base"
    ]
    assert points
    assert all(tm.ERROR_TYPE not in attrs for _, attrs in points)


async def test_a_failed_request_carries_its_error_type(otel_metrics: Metrics) -> None:
    want = labels(requested="rm-other", routed="rm-other", variant="rm-other", error="401")
    before = otel_metrics.value(tm.OPERATION_DURATION, **want)
    response = await post(
        {"model": "rm-other", "max_tokens": 5, "messages": TURN}, **{"x-test-status": "401"}
    )
    assert response.status_code == 401
    assert otel_metrics.value(tm.OPERATION_DURATION, **want) == before + 1


async def test_a_stream_records_time_to_first_token(otel_metrics: Metrics) -> None:
    want = labels(requested="rm-other", routed="rm-other")
    before = otel_metrics.value(tm.TIME_TO_FIRST_TOKEN, **want)
    outputs = otel_metrics.value(tm.TOKEN_USAGE, **want, **labels(tokens="output"))
    response = await post({"model": "rm-other", "max_tokens": 5, "stream": True, "messages": TURN})
    assert response.status_code == 200
    assert otel_metrics.value(tm.TIME_TO_FIRST_TOKEN, **want) == before + 1
    assert otel_metrics.value(tm.TOKEN_USAGE, **want, **labels(tokens="output")) == outputs + 1


async def test_a_request_not_read_is_not_counted(otel_metrics: Metrics) -> None:
    before = otel_metrics.value(tm.OPERATION_DURATION)
    transport = httpx.ASGITransport(app=stack())
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        await client.get("/v1/messages")
    assert otel_metrics.value(tm.OPERATION_DURATION) == before


# -- the tallies themselves -----------------------------------------------------------------


def test_bucket_bounds_fit_the_unit() -> None:
    assert tm.SECONDS_BUCKETS[0] == 0.005
    assert tm.SECONDS_BUCKETS[-1] == 600.0
    assert tm.TOKEN_BUCKETS[0] == 1
    assert tm.TOKEN_BUCKETS[-1] == 1048576
    assert list(tm.SECONDS_BUCKETS) == sorted(set(tm.SECONDS_BUCKETS))


@pytest.mark.parametrize(
    ("value", "bucket"),
    [(0.001, 0), (0.005, 0), (0.0051, 1), (0.3, 6), (600.0, 16), (601.0, 17)],
)
def test_a_value_lands_in_its_upper_inclusive_bucket(value: float, bucket: int) -> None:
    tally = rm.HistogramTally("t", "s", "test", tm.SECONDS_BUCKETS)
    tally.record(value, ("m", "m", "m", "a", "", "", ""))
    metric = tally.metric(0)
    assert metric is not None
    (point,) = metric.data.data_points
    counts = list(point.bucket_counts)  # type: ignore[union-attr]
    assert counts[bucket] == 1
    assert sum(counts) == 1
    assert (point.count, point.sum, point.min, point.max) == (1, value, value, value)  # type: ignore[union-attr]


def test_series_past_the_limit_go_to_one_overflow_series() -> None:
    tally = rm.HistogramTally("t", "s", "test", tm.SECONDS_BUCKETS)
    for i in range(rm.MAX_SERIES + 500):
        tally.record(1.0, (f"model-{i}", "", "", "", "", "", ""))
    metric = tally.metric(0)
    assert metric is not None
    points = list(metric.data.data_points)
    assert len(points) == rm.MAX_SERIES + 1
    (overflow,) = [p for p in points if p.attributes == {"otel.metric.overflow": True}]
    assert overflow.count == 500  # type: ignore[union-attr]


def test_bridge_is_idempotent_and_adds_to_switchyards_scope() -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = rm.bridge(rm.bridge(InMemoryMetricReader()))
    provider = MeterProvider(metric_readers=[reader])
    provider.get_meter(tm.SCOPE).create_counter("c").add(1)
    rm.duration.record(0.2, ("bridged", "", "", "", "", "", ""))
    data = reader.get_metrics_data()
    assert data is not None
    scopes = [s for rm_ in data.resource_metrics for s in rm_.scope_metrics]
    assert [s.scope.name for s in scopes].count(tm.SCOPE) == 1
    names = [m.name for s in scopes for m in s.metrics]
    assert names.count(tm.OPERATION_DURATION) == 1
    assert "c" in names
    provider.shutdown()


def test_the_prometheus_text_has_real_histograms() -> None:
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from opentelemetry.sdk.metrics import MeterProvider
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    reader = rm.bridge(PrometheusMetricReader(registry=registry))
    provider = MeterProvider(metric_readers=[reader])
    rm.duration.record(0.3, ("prom-model", "prom-model", "prom-model", "a", "", "", ""))
    text = generate_latest(registry).decode()
    provider.shutdown()
    assert "# TYPE gen_ai_client_operation_duration_seconds histogram" in text
    line = next(
        row
        for row in text.splitlines()
        if row.startswith("gen_ai_client_operation_duration_seconds_bucket")
        and 'gen_ai_request_model="prom-model"' in row
        and 'le="0.5"' in row
    )
    assert float(line.rpartition(" ")[2]) >= 1.0


def test_account_state_reads_each_state() -> None:
    from switchyard_mw.core.pool import AccountPool, AccountSpec, Outcome

    now = [100.0]
    pool = AccountPool(
        [
            AccountSpec(name="st-a", models=frozenset({"m", "n"}), failure_threshold=1),
            AccountSpec(name="st-b", models=frozenset({"m"})),
        ],
        clock=lambda: now[0],
    )
    assert [rm.account_state(pool, n) for n in pool.names] == [rm.CLOSED, rm.CLOSED]
    lease = pool.acquire("m")
    assert lease is not None
    assert lease.account == "st-a"
    pool.record(lease, Outcome.FAULT)
    assert rm.account_state(pool, "st-a") == rm.COOLED
    now[0] += 31
    probe = pool.acquire("n")
    assert probe is not None
    assert probe.probe
    assert rm.account_state(pool, "st-a") == rm.HALF_OPEN
    pool.hold("st-b", "m", 10)
    assert rm.account_state(pool, "st-b") == rm.THROTTLED


def test_account_state_gauge_is_exported(otel_metrics: Metrics) -> None:
    gateway = stack()  # builds a pool: its accounts are reported while it lives
    states = [attrs for name, attrs in otel_metrics.points() if name == tm.ACCOUNT_STATE]
    assert {tm.ACCOUNT: "acct-a"} in states
    assert gateway.pool.names == ("acct-a",)


def test_token_usage_keeps_input_and_output_apart_under_one_key() -> None:
    tally = rm.TokenTally("t", "{token}", "test", tm.TOKEN_BUCKETS)
    labels = ("m", "m", "m", "a", "", "", "")
    tally.record_usage(300, 40, labels)
    tally.record_usage(None, 2, labels)
    metric = tally.metric(0)
    assert metric is not None
    points = {p.attributes[tm.TOKEN_TYPE]: p for p in metric.data.data_points}
    assert set(points) == {"input", "output"}
    assert (points["input"].count, points["input"].sum) == (1, 300)  # type: ignore[union-attr]
    assert (points["output"].count, points["output"].sum) == (2, 42)  # type: ignore[union-attr]
    assert (points["output"].min, points["output"].max) == (2, 40)  # type: ignore[union-attr]
    assert sum(points["input"].bucket_counts) == 1  # type: ignore[union-attr]
