"""A real Envoy 1.40 running examples/envoy/envoy.yaml, the processor and the mock provider.

All three run on free loopback ports, started from this test process (Envoy dies with its
parent): the mock under uvicorn on a thread, the processor as a grpc.aio server on this
module's event loop, Envoy once for the module with `--disable-hot-restart` and its admin on
an ephemeral port. Each test installs its own config by swapping the servicer's `Policies`.
Envoy's OpenTelemetry tracer exports (OTLP/gRPC) to a real receiver, also in this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
import pytest_asyncio
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from envoy_rig import ENVOY_YAML, Rig, StartRig, port_of
from otlp_receiver import OtlpReceiver, ReceivedSpan
from servers import free_port
from switchyard_mw.core.pool import BreakerState
from switchyard_mw.core.variant_buckets import Split
from switchyard_mw.engine.answers import unreachable
from switchyard_mw.telemetry import names as tm
from switchyard_mw.testing import Behaviour
from switchyard_mw.testing.envoy import run_on_free_ports

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration]
DEAD_CLUSTER = """  - name: dead
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: dead
      endpoints:
      - lb_endpoints:
        - endpoint:
            address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
"""
"""A cluster beside the example's whose endpoint refuses connections (nothing listens)."""
ENVOY_RUNTIME = {"tracing.opentelemetry.min_flush_spans": 1}
"""Envoy's tracer batches spans (5 s or 5 spans by default): here each is exported as it ends."""
KEYS = {"KEY_A": "key-a", "KEY_B": "key-b", "KEY_J": "key-j"}
SALT = "live"


def config_text(mock_url: str, *, timeout_secs: float = 60, failure_threshold: int = 1) -> str:
    account = f"""
base_url = "{mock_url}"
models = ["claude-opus-5", "claude-opus-5-5", "claude-haiku-5"]
timeout_secs = {timeout_secs}
failure_threshold = {failure_threshold}
cooldown_secs = 30
envoy_cluster = "mock"
"""
    return f"""
[llm_clients.key-a]
api_key_env = "KEY_A"
auth = "x-api-key"
priority = 0
{account}
[llm_clients.key-b]
api_key_env = "KEY_B"
auth = "bearer"
priority = 1
{account}
[llm_clients.judge]
base_url = "{mock_url}"
api_key_env = "KEY_J"
models = ["gpt-judge"]

[canaries."claude-opus-5"]
variants = {{ "claude-opus-5-5" = 50.0 }}
salt = "{SALT}"

[routes.auto]
classifier = "llm"
judge = "judge"
judge_model = "gpt-judge"
judge_deadline_ms = 300
choices = {{ simple = "claude-haiku-5", complex = "claude-opus-5" }}
fallback = "claude-haiku-5"
"""


@pytest.fixture(scope="module")
def otlp() -> Iterator[OtlpReceiver]:
    """The collector Envoy's tracer exports to (OTLP/gRPC, the example's `otel_collector`)."""
    with OtlpReceiver(grpc=True) as receiver:
        yield receiver


def with_dead_cluster(envoy_yaml: str) -> str:
    return envoy_yaml.replace(
        "\n  clusters:\n", "\n  clusters:\n" + DEAD_CLUSTER.format(port=free_port()), 1
    )


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def rig(start_rig: StartRig, otlp: OtlpReceiver) -> AsyncIterator[Rig]:
    """Envoy's tracer exporting to `otlp`, each span as it ends; a `dead` cluster beside."""
    async with start_rig(
        config_text, KEYS, otel=otlp.grpc_port, runtime=ENVOY_RUNTIME, edit=with_dead_cluster
    ) as rig:
        yield rig


@pytest_asyncio.fixture(loop_scope="module")
async def http(rig: Rig) -> AsyncIterator[httpx.AsyncClient]:
    rig.mock.reset()
    async with httpx.AsyncClient(base_url=rig.envoy_url, timeout=10) as client:
        yield client


def message(model: str, *, user: str | None = None, max_tokens: int = 100) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "Hello"}],
    }
    if user is not None:
        body["metadata"] = {"user_id": user}
    return body


async def test_variants_are_rewritten_and_sticky(rig: Rig, http: httpx.AsyncClient) -> None:
    rig.configure()
    split = Split.build("claude-opus-5", [("claude-opus-5-5", 50.0)], SALT)
    users = [f"user-{i}" for i in range(8)]
    for user in users + users[:3]:
        response = await http.post(
            "/v1/messages",
            json=message("claude-opus-5", user=user),
            headers={"x-api-key": "caller-key", "x-switchyard-cluster": "nope"},
        )
        assert response.status_code == 200, response.text
        assert response.headers["x-switchyard-model"] == split.pick(user)
        assert response.json()["model"] == split.pick(user)
    seen = rig.mock.requests
    assert [r.model for r in seen] == [split.pick(u) for u in users + users[:3]]
    assert {split.pick(u) for u in users} == {"claude-opus-5", "claude-opus-5-5"}
    for record in seen:
        assert record.key == "key-a"  # the caller's key replaced by the account's
        assert "authorization" not in record.headers
        assert not any(h.startswith("x-switchyard") for h in record.headers)


async def test_a_large_body_is_rewritten_whole(rig: Rig, http: httpx.AsyncClient) -> None:
    """6 MiB: over gRPC's 4 MiB default and Envoy's 1 MiB buffer, both raised for this."""
    rig.configure()
    split = Split.build("claude-opus-5", [("claude-opus-5-5", 50.0)], SALT)
    user = next(u for u in (f"big-{i}" for i in range(100)) if split.pick(u) == "claude-opus-5-5")
    body = message("claude-opus-5", user=user)
    body["messages"][0]["content"] = "x" * (6 << 20)
    response = await http.post("/v1/messages", json=body)
    assert response.status_code == 200, response.text[:200]
    (record,) = rig.mock.requests
    assert record.model == "claude-opus-5-5"  # the model rewritten in the 6 MiB body
    assert len(record.body) > 6 << 20


async def test_bad_json_is_answered_in_the_wires_format(rig: Rig, http: httpx.AsyncClient) -> None:
    rig.configure()
    response = await http.post(
        "/v1/chat/completions", content=b"{oops", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert rig.mock.requests == []


async def test_envoy_enforces_the_deadline(
    rig: Rig, http: httpx.AsyncClient, otel_metrics: Any
) -> None:
    rig.configure(timeout_secs=1, failure_threshold=5)
    rig.mock.set_behaviour("key-a", Behaviour(headers_delay_secs=2))
    before = otel_metrics.value(tm.DEADLINE_EXCEEDED, phase="total")
    # A whole answer late past its deadline: Envoy's per-try timeout ends the try, the route
    # retries it on the next key, as through the ASGI front; the late key has its fault.
    started = time.monotonic()
    moved = await http.post("/v1/messages", json=message("claude-haiku-5", max_tokens=10))
    elapsed = time.monotonic() - started
    assert moved.status_code == 200, moved.text
    assert moved.headers["x-switchyard-account"] == "key-b"
    assert moved.headers["x-switchyard-deadline-ms"] == "1000"
    assert 0.9 <= elapsed < 1.8
    assert otel_metrics.value(tm.DEADLINE_EXCEEDED, phase="total") == before + 1
    # No key answers in time: the wire's 504 after each key's deadline.
    rig.mock.set_behaviour("key-b", Behaviour(headers_delay_secs=3))
    sent = len(rig.mock.requests)
    started = time.monotonic()
    short = await http.post("/v1/messages", json=message("claude-haiku-5", max_tokens=10))
    elapsed = time.monotonic() - started
    # Each key once: at the second try's per-try timeout, with no key left, the processor
    # answers Envoy's next retry itself rather than let it go to a late key again.
    assert [r.key for r in rig.mock.requests[sent:]] == ["key-a", "key-b"]
    assert short.status_code == 504
    assert short.json() == {
        "type": "error",
        "error": {"type": "deadline_exceeded", "message": short.json()["error"]["message"]},
    }
    assert 1.9 <= elapsed < 2.8
    assert otel_metrics.value(tm.DEADLINE_EXCEEDED, phase="total") == before + 3
    # 64000 tokens at 128k an hour: 600 s (the cap), so the 2 s answer arrives.
    rig.mock.set_behaviour("key-b", Behaviour())
    long = await http.post("/v1/messages", json=message("claude-haiku-5", max_tokens=64000))
    assert long.status_code == 200
    assert long.headers["x-switchyard-account"] == "key-a"
    assert long.headers["x-switchyard-deadline-ms"] == "600000"


@pytest.mark.parametrize(
    ("budget", "low", "high"),
    [(None, 60000, 60000), ("90000", 60000, 60000), ("3000", 2500, 3000)],
)
async def test_the_deadline_header_reports_the_deadline_in_force(
    rig: Rig, http: httpx.AsyncClient, otel_spans: Any, budget: str | None, low: int, high: int
) -> None:
    """The budget included, as the ASGI stack reports it; the processor's request span too."""
    rig.configure()
    for body in (message("claude-haiku-5"), {**message("claude-haiku-5"), "stream": True}):
        trace_id = secrets.token_hex(16)
        headers = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
        if budget is not None:
            headers["x-switchyard-timeout-ms"] = budget
        response = await http.post("/v1/messages", json=body, headers=headers)
        assert response.status_code == 200, response.text
        reported = int(response.headers["x-switchyard-deadline-ms"])
        assert low <= reported <= high, body
        deadline = time.monotonic() + 5
        while not (found := request_spans(otel_spans, trace_id)):
            assert time.monotonic() < deadline, "the processor's request span never ended"
            await asyncio.sleep(0.02)
        assert [dict(s.attributes or {})[tm.DEADLINE_MS] for s in found] == [reported]


def request_spans(exporter: Any, trace_id: str) -> list[ReadableSpan]:
    return [
        s
        for s in exporter.get_finished_spans()
        if s.name == tm.SPAN_REQUEST
        and s.context is not None
        and s.context.trace_id == int(trace_id, 16)
    ]


async def test_a_stream_must_start_in_time_but_may_run_long(
    rig: Rig, http: httpx.AsyncClient, otel_metrics: Any
) -> None:
    rig.configure(timeout_secs=1, failure_threshold=5)
    body = {**message("claude-haiku-5"), "stream": True}
    # Started at once, then 1.2 s of chunks: longer than timeout_secs, and never cut.
    rig.mock.set_behaviour("key-a", Behaviour(chunks=4, chunk_interval_secs=0.4))
    slow = await http.post("/v1/messages", json=body)
    assert slow.status_code == 200
    assert "message_stop" in slow.text
    # Not started within timeout_secs (Envoy's per-try timeout): counted as `headers`, the
    # key's fault, and retried on the next key, as through the ASGI front.
    rig.configure(timeout_secs=1, failure_threshold=5)
    rig.mock.set_behaviour("key-a", Behaviour(headers_delay_secs=2))
    before = otel_metrics.value(tm.DEADLINE_EXCEEDED, phase="headers")
    started = time.monotonic()
    moved = await http.post("/v1/messages", json=body)
    assert moved.status_code == 200
    assert moved.headers["x-switchyard-account"] == "key-b"
    assert 1.0 <= time.monotonic() - started < 1.8
    assert otel_metrics.value(tm.DEADLINE_EXCEEDED, phase="headers") == before + 1
    # No key starts in time: 504 in the wire's format.
    rig.mock.set_behaviour("key-b", Behaviour(headers_delay_secs=5))
    stalled = await http.post("/v1/messages", json=body)
    assert stalled.status_code == 504
    assert stalled.json()["error"]["type"] == "deadline_exceeded"
    assert otel_metrics.value(tm.DEADLINE_EXCEEDED, phase="headers") >= before + 3


@pytest.mark.parametrize("status", [401, 402, 403, 503])
async def test_a_refused_key_fails_over_inside_the_request(
    rig: Rig, http: httpx.AsyncClient, otel_metrics: Any, status: int
) -> None:
    policies = rig.configure()
    rig.mock.set_behaviour("key-a", Behaviour(status=status))
    faults = otel_metrics.value(tm.ACCOUNT_FAULTS, **{tm.ACCOUNT: "key-a"}, status=str(status))
    cooled = otel_metrics.value(tm.ACCOUNT_COOLED, **{tm.ACCOUNT: "key-a"})
    response = await http.post("/v1/messages", json=message("claude-haiku-5"))
    assert response.status_code == 200, response.text
    assert response.headers["x-switchyard-account"] == "key-b"
    assert response.headers["x-switchyard-attempts"] == "2"
    assert "x-switchyard-retry" not in response.headers
    assert [r.key for r in rig.mock.requests] == ["key-a", "key-b"]
    # Cooled for this model (a 503: only this model of the account's three; a refusal: all).
    assert not policies.pool.closed_for("key-a", "claude-haiku-5")
    assert (policies.pool.status_of("key-a").state is BreakerState.COOLED) == (status < 500)
    assert (
        otel_metrics.value(tm.ACCOUNT_FAULTS, **{tm.ACCOUNT: "key-a"}, status=str(status))
        == faults + 1
    )
    assert otel_metrics.value(tm.ACCOUNT_COOLED, **{tm.ACCOUNT: "key-a"}) == cooled + 1
    # The next request does not try the cooled key at all.
    rig.mock.clear_requests()
    again = await http.post("/v1/messages", json=message("claude-haiku-5"))
    assert again.headers["x-switchyard-attempts"] == "1"
    assert [r.key for r in rig.mock.requests] == ["key-b"]


async def test_a_429_reaches_the_client_when_no_key_can_absorb_it(
    rig: Rig, http: httpx.AsyncClient
) -> None:
    policies = rig.configure()
    for key in ("key-a", "key-b"):
        rig.mock.set_behaviour(key, Behaviour(status=429))
    response = await http.post("/v1/messages", json=message("claude-haiku-5"))
    assert response.status_code == 429
    assert response.headers["retry-after"] == "1"
    assert [r.key for r in rig.mock.requests] == ["key-a", "key-b"]
    assert policies.pool.status_of("key-a").state is BreakerState.CLOSED  # a throttle never cools


async def test_a_stalled_judge_fails_open(
    rig: Rig, http: httpx.AsyncClient, otel_metrics: Any
) -> None:
    rig.configure()
    rig.mock.set_behaviour("key-j", Behaviour(headers_delay_secs=3))
    before = otel_metrics.value(tm.CLASSIFIER_FAIL_OPEN, route="auto", reason="deadline")
    started = time.monotonic()
    response = await http.post("/v1/messages", json=message("auto"))
    assert time.monotonic() - started < 1.0
    assert response.status_code == 200
    assert response.headers["x-switchyard-route"] == "fail_open:deadline"
    assert response.headers["x-switchyard-model"] == "claude-haiku-5"
    after = otel_metrics.value(tm.CLASSIFIER_FAIL_OPEN, route="auto", reason="deadline")
    assert after == before + 1


async def test_the_official_sdk_streams_through_envoy(rig: Rig) -> None:
    rig.configure()
    rig.mock.reset()
    client = anthropic.AsyncAnthropic(base_url=rig.envoy_url, api_key="caller", max_retries=0)
    async with client.messages.stream(**message("claude-haiku-5")) as stream:
        text = await stream.get_final_text()
    assert text == "Hello from the mock provider."
    assert rig.mock.requests[0].stream
    await client.close()


async def test_a_processor_that_is_down_fails_closed(rig: Rig, tmp_path: Path) -> None:
    """failure_mode_allow: false with status_on_error 503: nothing reaches the provider."""
    rig.mock.reset()
    nobody = free_port()  # nothing listens there
    with run_on_free_ports(ENVOY_YAML, processor=nobody, upstream=port_of(rig.mock_url)) as envoy:
        async with httpx.AsyncClient(timeout=10) as client:
            response = await client.post(
                f"{envoy.url}/v1/messages",
                json=message("claude-haiku-5"),
                headers={"x-api-key": "caller"},
            )
    assert response.status_code == 503  # Envoy's own local reply, empty body; SDKs retry it
    assert rig.mock.requests == []


class _Forward(SpanProcessor):
    """Hands the spans that end to `to`, while it is set: a span pipeline that can be undone.

    The session's tracer provider (conftest's, recording in memory) takes processors but never
    gives one back, so this one is added once and pointed at an exporter only while needed.
    """

    to: SpanProcessor | None = None
    installed = False

    def on_end(self, span: ReadableSpan) -> None:
        if (to := self.to) is not None:
            to.on_end(span)


_FORWARD = _Forward()


@contextlib.contextmanager
def processor_exporting_to(otlp: OtlpReceiver) -> Iterator[None]:
    """The processor's spans also exported over OTLP/HTTP to `otlp`, as a deployment would."""
    provider = trace.get_tracer_provider()
    assert isinstance(provider, TracerProvider)
    if not _FORWARD.installed:
        provider.add_span_processor(_FORWARD)
        _FORWARD.installed = True
    exporter = OTLPSpanExporter(endpoint=f"{otlp.endpoint}/v1/traces", timeout=2)
    _FORWARD.to = batch = BatchSpanProcessor(exporter, schedule_delay_millis=20)
    try:
        yield
    finally:
        _FORWARD.to = None
        batch.shutdown()  # type: ignore[no-untyped-call]  # exports what is left, then stops


ENVOY_EXTPROC_SPAN = "async envoy.service.ext_proc.v3.ExternalProcessor.Process egress"
"""Envoy's span of one ext_proc stream (a gRPC call to the processor)."""


def one_trace(otlp: OtlpReceiver, trace_id: str) -> dict[str, list[ReceivedSpan]] | None:
    """The spans of `trace_id` by name, once Envoy's and the processor's have all arrived."""
    spans: dict[str, list[ReceivedSpan]] = {}
    for span in otlp.spans():
        if span.trace_id == trace_id:
            spans.setdefault(span.name, []).append(span)
    expected = {
        "ingress": 1,
        ENVOY_EXTPROC_SPAN: 1,  # the router-level filter (the upstream-level one: refusals only)
        tm.SPAN_REQUEST: 1,
        tm.SPAN_JUDGE: 1,
        tm.SPAN_ATTEMPT: 1,
    }
    return spans if all(len(spans.get(n, ())) >= k for n, k in expected.items()) else None


async def test_the_processors_spans_join_envoys_trace(
    rig: Rig, http: httpx.AsyncClient, otlp: OtlpReceiver
) -> None:
    """One trace, in one collector: the client's context, Envoy's spans, the processor's
    decisions (its request span, the judge, the attempt) and the upstream call."""
    rig.configure()
    rig.mock.set_behaviour("key-j", Behaviour(reply="simple"))
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    with processor_exporting_to(otlp):
        response = await http.post(
            "/v1/messages",
            json=message("auto"),
            headers={"traceparent": f"00-{trace_id}-{client_span}-01"},
        )
        assert response.status_code == 200, response.text
        assert response.headers["x-switchyard-route"] == "judge:simple"
        try:
            spans = otlp.wait_for(lambda otlp: one_trace(otlp, trace_id), timeout=3)
        except AssertionError:
            got = sorted(s.name for s in otlp.spans() if s.trace_id == trace_id)
            pytest.fail(f"trace {trace_id} incomplete after 3 s; it holds only {got}")

    # Envoy's spans came from Envoy, over OTLP/gRPC; the processor's from this process, OTLP/HTTP.
    envoys = spans["ingress"] + spans[ENVOY_EXTPROC_SPAN]
    chat = tm.SPAN_CLIENT.format(model="claude-haiku-5")
    ours = spans[tm.SPAN_REQUEST] + spans[tm.SPAN_JUDGE] + spans[tm.SPAN_ATTEMPT] + spans[chat]
    assert {(s.service, s.transport) for s in envoys} == {("envoy", "grpc")}
    assert {s.transport for s in ours} == {"http"}
    assert sorted(spans) == sorted(
        ["ingress", ENVOY_EXTPROC_SPAN, tm.SPAN_REQUEST, tm.SPAN_JUDGE, tm.SPAN_ATTEMPT, chat]
    )
    assert all(len(spans[name]) == 1 for name in spans)

    # client span -> Envoy's ingress -> Envoy's ext_proc call -> switchyard.request -> decisions
    (ingress,) = spans["ingress"]
    assert ingress.span.kind == Span.SPAN_KIND_SERVER
    assert ingress.parent_id == client_span
    extproc_calls = {s.span_id for s in spans[ENVOY_EXTPROC_SPAN]}
    assert {s.parent_id for s in spans[ENVOY_EXTPROC_SPAN]} == {ingress.span_id}
    assert {s.span.kind for s in spans[ENVOY_EXTPROC_SPAN]} == {Span.SPAN_KIND_CLIENT}
    (request,) = spans[tm.SPAN_REQUEST]
    assert request.parent_id in extproc_calls
    assert request.span.kind == Span.SPAN_KIND_SERVER
    assert request.attributes[tm.REQUEST_MODEL] == "auto"
    (judge,) = spans[tm.SPAN_JUDGE]
    (attempt,) = spans[tm.SPAN_ATTEMPT]
    assert judge.parent_id == attempt.parent_id == request.span_id
    assert attempt.attributes[tm.ACCOUNT] == "key-a"
    (client,) = spans[chat]  # the attempt under the GenAI conventions
    assert client.parent_id == attempt.span_id
    assert client.span.kind == Span.SPAN_KIND_CLIENT
    assert client.attributes[tm.OPERATION_NAME] == "chat"
    assert client.attributes[tm.REQUEST_MODEL] == "claude-haiku-5"

    # The calls out carry the same trace: the judge's from the processor (its judge span),
    # the provider's from Envoy (its ingress span: the router spawns no span of its own).
    judged, forwarded = rig.mock.requests
    assert (judged.model, forwarded.model) == ("gpt-judge", "claude-haiku-5")
    assert judged.headers["traceparent"] == f"00-{trace_id}-{judge.span_id}-01"
    assert forwarded.headers["traceparent"] == f"00-{trace_id}-{ingress.span_id}-01"


async def test_a_429_with_a_retry_time_holds_its_key_for_the_next_requests(
    rig: Rig, http: httpx.AsyncClient, otel_metrics: Any
) -> None:
    policies = rig.configure()
    held = otel_metrics.value(
        tm.ACCOUNT_THROTTLED, **{tm.ACCOUNT: "key-a", tm.RESPONSE_MODEL: "claude-haiku-5"}
    )
    rig.mock.set_behaviour("key-a", Behaviour(status=429, headers={"retry-after": "20"}))
    first = await http.post("/v1/messages", json=message("claude-haiku-5"))
    assert (first.status_code, first.headers["x-switchyard-attempts"]) == (200, "2")
    assert (
        otel_metrics.value(
            tm.ACCOUNT_THROTTLED, **{tm.ACCOUNT: "key-a", tm.RESPONSE_MODEL: "claude-haiku-5"}
        )
        == held + 1
    )
    # The next request goes straight to the other key: the held one is not even tried.
    rig.mock.clear_requests()
    second = await http.post("/v1/messages", json=message("claude-haiku-5"))
    assert second.headers["x-switchyard-attempts"] == "1"
    assert [r.key for r in rig.mock.requests] == ["key-b"]
    # Both held: the processor answers 429 itself, calling no upstream.
    rig.mock.set_behaviour("key-b", Behaviour(status=429, headers={"retry-after-ms": "9000"}))
    await http.post("/v1/messages", json=message("claude-haiku-5"))
    rig.mock.clear_requests()
    local = await http.post("/v1/messages", json=message("claude-haiku-5"))
    assert local.status_code == 429
    assert local.json()["error"]["type"] == "rate_limited"
    assert 1 <= int(local.headers["retry-after"]) <= 9
    assert rig.mock.requests == []
    for key in ("key-a", "key-b"):
        assert policies.pool.status_of(key).state is BreakerState.CLOSED  # never a cooling


@pytest.mark.parametrize(
    ("path", "error_of"),
    [
        ("/v1/messages", lambda body: body["error"]),
        ("/v1/chat/completions", lambda body: body["error"]),
    ],
)
async def test_envoys_own_reply_when_no_provider_answered_is_in_the_wires_shape(
    rig: Rig, http: httpx.AsyncClient, path: str, error_of: Any
) -> None:
    """An account whose cluster refuses connections: Envoy answers itself (503 "upstream connect
    error ..." in text/plain, without the shipped local_reply_config); the client gets 502
    upstream_unreachable in the wire's error shape, as from the ASGI front, and the account is
    charged a connect fault."""
    policies = rig.install(
        config_text(rig.mock_url).replace('envoy_cluster = "mock"', 'envoy_cluster = "dead"', 1)
    )
    body: dict[str, Any] = message("claude-haiku-5")
    if path != "/v1/messages":
        body = {"model": "claude-haiku-5", "messages": body["messages"]}
    response = await http.post(path, json=body, headers={"x-api-key": "caller"})
    assert response.status_code == 502, response.text
    assert response.headers["content-type"] == "application/json"
    error = error_of(response.json())
    assert error["type"] == "upstream_unreachable"
    assert error["message"] == unreachable().message  # the ASGI front's very answer
    if path == "/v1/messages":
        assert response.json()["type"] == "error"
    else:
        assert error["code"] == "upstream_unreachable"
    assert response.headers["x-switchyard-account"] == "key-a"
    assert rig.mock.requests == []  # nothing reached a provider
    assert policies.pool.status_of("key-a", model="claude-haiku-5").consecutive_faults == 1
