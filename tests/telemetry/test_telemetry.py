"""The request's trace, in process: span tree, attributes, propagation, privacy, `otel.configure`.

The stack serves the example's `gateway.Forwarder`, whose httpx client reaches the mock
provider in process (`httpx.ASGITransport`), so the outbound call and its `traceparent` are
the real ones. Spans and metrics come from the session's in-memory pipeline (conftest).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import pytest
from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from conftest import Metrics
from servers import ROOT
from switchyard_mw.asgi.stack import switchyard_stack
from switchyard_mw.config import parse_config
from switchyard_mw.gateway import WIRE_ROUTES, Forwarder
from switchyard_mw.telemetry import names as tm
from switchyard_mw.testing import Behaviour, MockProvider
from usage_streams import all_input

ENV = {"KEY_A": "sk-secret-a-0001", "KEY_B": "sk-secret-b-0002", "KEY_J": "sk-secret-judge-0003"}
CALLER_KEY = "sk-caller-secret-0004"
PROMPT = "my confidential prompt about zebra-4417"
USER_ID = "user-raw-id-8812"
SECRETS = (*ENV.values(), CALLER_KEY, PROMPT, USER_ID)

CONFIG = """
[llm_clients.a]
base_url = "http://mock.test"
api_key_env = "KEY_A"
auth = "x-api-key"
models = ["claude-opus-5", "claude-opus-5-5"]
priority = 0
failure_threshold = 1

[llm_clients.b]
base_url = "http://mock.test"
api_key_env = "KEY_B"
auth = "bearer"
models = ["claude-opus-5", "claude-opus-5-5"]
priority = 1

[llm_clients.judge]
base_url = "http://mock.test"
api_key_env = "KEY_J"
models = ["gpt-judge"]

[canaries."claude-opus-5"]
variants = { "claude-opus-5-5" = 50.0 }

[routes.auto]
classifier = "llm"
judge = "judge"
judge_model = "gpt-judge"
judge_deadline_ms = 2000
choices = { simple = "claude-opus-5" }
fallback = "claude-opus-5"
"""

MESSAGE = {
    "model": "claude-opus-5",
    "max_tokens": 64,
    "metadata": {"user_id": USER_ID},
    "messages": [{"role": "user", "content": PROMPT}],
}


class Gateway:
    def __init__(self, mock: MockProvider, app: Any) -> None:
        self.mock = mock
        self.app = app

    def client(self, app: Any = None) -> httpx.AsyncClient:
        transport = httpx.ASGITransport(app=app or self.app)
        return httpx.AsyncClient(transport=transport, base_url="http://gw.test")


@pytest.fixture
async def gw() -> AsyncIterator[Gateway]:
    mock = MockProvider()
    upstream = httpx.AsyncClient(transport=httpx.ASGITransport(app=mock))
    forwarder = Forwarder(upstream)
    app = Starlette(routes=[Route(p, forwarder.forward, methods=["POST"]) for p in WIRE_ROUTES])
    stack = switchyard_stack(
        app, config=parse_config(CONFIG), environ=ENV, judge_http_client=upstream
    )
    yield Gateway(mock, stack)
    await upstream.aclose()


def named(spans: Sequence[ReadableSpan], name: str) -> list[ReadableSpan]:
    return sorted((s for s in spans if s.name == name), key=lambda s: s.start_time or 0)


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def attempt_of(call: ReadableSpan, spans: Sequence[ReadableSpan]) -> int | None:
    """The span id of the attempt an outbound call belongs to: its parent is the attempt's
    GenAI CLIENT span (`chat {model}`), whose parent is the attempt."""
    (client,) = [s for s in spans if s.context and s.context.span_id == parent_of(call)]
    assert client.name.startswith("chat ")
    assert client.kind is SpanKind.CLIENT
    return parent_of(client)


def traceparent(span: ReadableSpan) -> str:
    ctx = span.context
    assert ctx is not None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"


# --- the span tree ---------------------------------------------------------------------------


async def test_failover_once_two_attempts_each_with_its_outbound_call(
    gw: Gateway, otel_spans: InMemorySpanExporter
) -> None:
    gw.mock.set_behaviour(ENV["KEY_A"], Behaviour(status=500))
    async with gw.client() as client:
        reply = await client.post("/v1/messages", json=MESSAGE, headers={"x-api-key": CALLER_KEY})
    assert reply.status_code == 200
    assert reply.headers["x-switchyard-attempts"] == "2"

    spans = otel_spans.get_finished_spans()
    (request,) = named(spans, tm.SPAN_REQUEST)
    attempts = named(spans, tm.SPAN_ATTEMPT)
    calls = named(spans, tm.SPAN_OUTBOUND)
    assert (len(attempts), len(calls)) == (2, 2)
    assert request.context is not None
    assert request.kind is SpanKind.SERVER
    assert {s.context.trace_id for s in (*attempts, *calls) if s.context} == {
        request.context.trace_id
    }
    for attempt, call in zip(attempts, calls, strict=True):
        assert attempt.context is not None
        assert parent_of(attempt) == request.context.span_id
        assert attempt_of(call, spans) == attempt.context.span_id
        assert call.kind is SpanKind.CLIENT

    first, second = attempts
    assert dict(first.attributes or {}) == {
        tm.ACCOUNT: "a",
        tm.ATTEMPT_PROBE: False,
        tm.REQUEST_MODEL: reply.headers["x-switchyard-model"],  # the variant, when split
        tm.ATTEMPT_STATUS: "500",
        tm.ATTEMPT_OUTCOME: "fault",
    }
    assert first.status.status_code is StatusCode.ERROR
    assert dict(second.attributes or {})[tm.ATTEMPT_OUTCOME] == "success"
    assert dict(second.attributes or {})[tm.ACCOUNT] == "b"

    failed, answered = (dict(c.attributes or {}) for c in calls)
    assert failed[tm.HTTP_STATUS] == 500
    assert failed[tm.ERROR_TYPE] == "500"
    assert answered[tm.HTTP_STATUS] == 200
    assert tm.ERROR_TYPE not in answered
    assert answered[tm.URL_FULL] == "http://mock.test/v1/messages"
    assert (answered[tm.SERVER_ADDRESS], answered[tm.SERVER_PORT]) == ("mock.test", 80)

    usage = reply.json()["usage"]
    attributes = dict(request.attributes or {})
    assert attributes[tm.RESPONSE_MODEL] in ("claude-opus-5", "claude-opus-5-5")
    assert {k: v for k, v in attributes.items() if k != tm.RESPONSE_MODEL} == {
        tm.HTTP_METHOD: "POST",
        tm.HTTP_STATUS: 200,
        tm.REQUEST_MODEL: "claude-opus-5",
        tm.REQUEST_MAX_TOKENS: 64,
        tm.ACCOUNT: "b",
        tm.ATTEMPTS: 2,
        tm.DEADLINE_MS: 60000,
        tm.VARIANT_KEY_KIND: "user",
        tm.VARIANT_KEY_HASH: tm.short_hash(USER_ID),
        tm.USAGE_INPUT_TOKENS: all_input(usage),  # cached input included
        tm.USAGE_OUTPUT_TOKENS: usage["output_tokens"],
        tm.USAGE_CACHE_READ_TOKENS: usage["cache_read_input_tokens"],
        tm.USAGE_CACHE_CREATION_TOKENS: usage["cache_creation_input_tokens"],
    }  # no gen_ai.provider.name: mock.test names no provider

    # Each outbound call told the provider which span it was.
    assert [r.headers["traceparent"] for r in gw.mock.requests] == [traceparent(c) for c in calls]


async def test_judge_failing_open_is_a_child_span_and_the_route_says_why(
    gw: Gateway, otel_spans: InMemorySpanExporter
) -> None:
    gw.mock.set_behaviour(ENV["KEY_J"], Behaviour(status=500))
    body = {"model": "auto", "messages": [{"role": "user", "content": PROMPT}]}
    headers = {"authorization": f"Bearer {CALLER_KEY}"}
    async with gw.client() as client:
        reply = await client.post("/v1/chat/completions", json=body, headers=headers)
    assert reply.status_code == 200
    assert reply.headers["x-switchyard-route"] == "fail_open:http_error"

    spans = otel_spans.get_finished_spans()
    (request,) = named(spans, tm.SPAN_REQUEST)
    (judge,) = named(spans, tm.SPAN_JUDGE)
    (attempt,) = named(spans, tm.SPAN_ATTEMPT)
    (call,) = named(spans, tm.SPAN_OUTBOUND)
    assert request.context is not None
    assert attempt.context is not None
    assert parent_of(judge) == request.context.span_id
    assert parent_of(attempt) == request.context.span_id
    assert attempt_of(call, spans) == attempt.context.span_id
    assert judge.kind is SpanKind.CLIENT
    assert (judge.end_time or 0) <= (attempt.start_time or 0)  # decided before the call
    assert dict(judge.attributes or {}) == {
        tm.JUDGE_ROUTE: "auto",
        tm.REQUEST_MODEL: "gpt-judge",
        tm.JUDGE_OUTCOME: "fail_open",
        tm.JUDGE_REASON: "http_error",
    }
    assert judge.status.status_code is StatusCode.ERROR
    # The judge was told which span asked it, as the provider is.
    (judge_call,) = [r for r in gw.mock.requests if r.key == ENV["KEY_J"]]
    assert judge.context is not None
    assert judge_call.headers["traceparent"] == traceparent(judge)

    attributes = dict(request.attributes or {})
    assert attributes[tm.ROUTE] == "fail_open:http_error"
    assert attributes[tm.REQUEST_MODEL] == "auto"
    assert attributes[tm.RESPONSE_MODEL] in ("claude-opus-5", "claude-opus-5-5")
    usage = reply.json()["usage"]
    assert attributes[tm.USAGE_INPUT_TOKENS] == usage["prompt_tokens"]
    assert attributes[tm.USAGE_OUTPUT_TOKENS] == usage["completion_tokens"]


class SlowStream(httpx.AsyncBaseTransport):
    """An upstream whose headers come at once and whose SSE events trickle in after."""

    def __init__(self) -> None:
        self.headers_at = 0.0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        async def events() -> AsyncIterator[bytes]:
            for n in range(3):
                await asyncio.sleep(0.05)
                yield f"event: ping\ndata: {n}\n\n".encode()

        self.headers_at = time.time_ns()
        headers = {"content-type": "text/event-stream"}
        return httpx.Response(200, headers=headers, content=events())


async def test_streamed_call_span_lasts_until_the_stream_ends(
    otel_spans: InMemorySpanExporter,
) -> None:
    upstream = SlowStream()
    forwarder = Forwarder(httpx.AsyncClient(transport=upstream))
    app = Starlette(routes=[Route(p, forwarder.forward, methods=["POST"]) for p in WIRE_ROUTES])
    stack = switchyard_stack(app, config=parse_config(CONFIG), environ=ENV)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=stack), base_url="http://gw.test"
    ) as client:
        reply = await client.post("/v1/messages", json={**MESSAGE, "stream": True})
    assert reply.text.count("event: ping") == 3
    spans = otel_spans.get_finished_spans()
    (attempt,) = named(spans, tm.SPAN_ATTEMPT)
    (call,) = named(spans, tm.SPAN_OUTBOUND)
    assert attempt.context is not None
    assert attempt_of(call, spans) == attempt.context.span_id
    # Not over when the headers came: over when the last event had been read.
    assert (call.end_time or 0) - upstream.headers_at >= 0.15e9
    assert (call.end_time or 0) <= (attempt.end_time or 0)


async def test_an_asgi_instrumentation_span_carries_the_decisions(
    gw: Gateway, otel_spans: InMemorySpanExporter
) -> None:
    instrumented = OpenTelemetryMiddleware(gw.app, exclude_spans=["receive", "send"])
    async with gw.client(instrumented) as client:
        reply = await client.post("/v1/messages", json=MESSAGE)
    assert reply.status_code == 200
    spans = otel_spans.get_finished_spans()
    assert named(spans, tm.SPAN_REQUEST) == []  # no second request span
    (server,) = [s for s in spans if s.kind is SpanKind.SERVER]
    (attempt,) = named(spans, tm.SPAN_ATTEMPT)
    assert server.context is not None
    assert parent_of(attempt) == server.context.span_id
    attributes = dict(server.attributes or {})
    assert attributes[tm.ACCOUNT] == "a"
    assert attributes[tm.ATTEMPTS] == 1
    assert attributes[tm.REQUEST_MODEL] == "claude-opus-5"


async def test_own_request_span_continues_the_callers_trace(
    gw: Gateway, otel_spans: InMemorySpanExporter
) -> None:
    trace_id, span_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    incoming = f"00-{trace_id}-{span_id}-01"
    async with gw.client() as client:
        await client.post("/v1/messages", json=MESSAGE, headers={"traceparent": incoming})
    (request,) = named(otel_spans.get_finished_spans(), tm.SPAN_REQUEST)
    assert request.context is not None
    assert request.parent is not None
    assert f"{request.context.trace_id:032x}" == trace_id
    assert f"{request.parent.span_id:016x}" == span_id
    assert request.parent.is_remote
    # The caller's traceparent is not passed on as it was: the provider sees our call's span.
    (sent,) = gw.mock.requests
    assert sent.headers["traceparent"].startswith(f"00-{trace_id}-")
    assert sent.headers["traceparent"] != incoming


# --- privacy ---------------------------------------------------------------------------------


def span_texts(span: ReadableSpan) -> list[str]:
    """Every string a span exports: name, attributes, events, links, status, resource."""
    texts = [span.name, span.status.description or ""]
    texts += [f"{k}={v}" for k, v in (span.attributes or {}).items()]
    for event in span.events:
        texts += [event.name, *(f"{k}={v}" for k, v in (event.attributes or {}).items())]
    for link in span.links:
        texts += [f"{k}={v}" for k, v in (link.attributes or {}).items()]
    texts += [f"{k}={v}" for k, v in span.resource.attributes.items()]
    return texts


async def test_no_key_prompt_or_user_id_in_any_span_or_metric(
    gw: Gateway, otel_spans: InMemorySpanExporter, otel_metrics: Metrics
) -> None:
    gw.mock.set_behaviour(ENV["KEY_A"], Behaviour(status=500))
    gw.mock.set_behaviour(ENV["KEY_J"], Behaviour(status=500))
    chat = {"model": "auto", "user": USER_ID, "messages": [{"role": "user", "content": PROMPT}]}
    async with gw.client() as client:
        await client.post("/v1/messages", json=MESSAGE, headers={"x-api-key": CALLER_KEY})
        await client.post("/v1/messages", json={**MESSAGE, "stream": True})
        await client.post("/v1/chat/completions", json=chat, headers={"x-api-key": CALLER_KEY})
    spans = otel_spans.get_finished_spans()
    texts = [t for s in spans for t in span_texts(s)]
    texts += [f"{name} {attributes}" for name, attributes in otel_metrics.points()]
    assert any(tm.short_hash(USER_ID) in t for t in texts)  # the scan does see attributes
    leaks = [(secret, t) for t in texts for secret in SECRETS if secret in t]
    assert leaks == []


TENANTS = f"""
[tenants.team]
keys = ["sha256:{hashlib.sha256(CALLER_KEY.encode()).hexdigest()}"]
limits = [{{ tokens = 1_000_000, per = "day" }}, {{ requests = 2, per = "day" }}]
[prices."claude-opus-5"]
input = 15.0
output = 75.0
[prices."claude-opus-5-5"]
input = 15.0
output = 75.0
"""


async def test_a_tenant_is_named_on_spans_and_metrics_and_its_key_nowhere(
    otel_spans: InMemorySpanExporter, otel_metrics: Metrics
) -> None:
    mock = MockProvider()
    upstream = httpx.AsyncClient(transport=httpx.ASGITransport(app=mock))
    forwarder = Forwarder(upstream)
    app = Starlette(routes=[Route(p, forwarder.forward, methods=["POST"]) for p in WIRE_ROUTES])
    config = parse_config(CONFIG + TENANTS)
    stack = switchyard_stack(app, config=config, environ=ENV, judge_http_client=upstream)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=stack), base_url="http://gw.test"
    ) as client:
        for _ in range(3):  # the third is refused: 2 requests a day
            await client.post("/v1/messages", json=MESSAGE, headers={"x-api-key": CALLER_KEY})
        await client.post("/v1/messages", json=MESSAGE, headers={"x-api-key": "sk-wrong-0005"})
    await upstream.aclose()
    (first, _, refused, wrong) = named(otel_spans.get_finished_spans(), tm.SPAN_REQUEST)
    assert dict(first.attributes or {})[tm.TENANT] == "team"
    assert dict(refused.attributes or {})[tm.TENANT] == "team"
    assert tm.TENANT not in dict(wrong.attributes or {})
    points = list(otel_metrics.points())
    usage = [a for name, a in points if name == tm.TOKEN_USAGE and a.get(tm.TENANT) == "team"]
    assert usage
    costs = [a for name, a in points if name == tm.COST and a.get(tm.TENANT) == "team"]
    assert {a[tm.RESPONSE_MODEL] for a in costs} <= {"claude-opus-5", "claude-opus-5-5"}
    assert costs
    refusals = [a for name, a in points if name == tm.LIMIT_REFUSALS]
    assert {tm.TENANT: "team", "limit": "requests/day"} in refusals  # (cumulative points)
    assert all(set(a) == {tm.TENANT, "limit"} for a in refusals)
    texts = [t for s in otel_spans.get_finished_spans() for t in span_texts(s)]
    texts += [f"{name} {attributes}" for name, attributes in points]
    assert [t for t in texts if "sk-caller" in t or "sk-wrong" in t] == []


async def test_exception_text_never_reaches_a_span(otel_spans: InMemorySpanExporter) -> None:
    async def leaky(request: Request) -> Response:
        raise RuntimeError(f"upstream said no to {PROMPT!r}")

    app = Starlette(routes=[Route(p, leaky, methods=["POST"]) for p in WIRE_ROUTES])
    stack = switchyard_stack(app, config=parse_config(CONFIG), environ=ENV)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=stack), base_url="http://gw.test"
    ) as client:
        # Starlette answers 500 and re-raises; an app's own exception is no account's
        # fault, so there is no failover: it reaches the server after one attempt.
        with pytest.raises(RuntimeError):
            await client.post("/v1/messages", json=MESSAGE)
    spans = otel_spans.get_finished_spans()
    attempts = named(spans, tm.SPAN_ATTEMPT)
    assert [dict(a.attributes or {})[tm.ERROR_TYPE] for a in attempts] == ["RuntimeError"]
    (request,) = named(spans, tm.SPAN_REQUEST)
    assert dict(request.attributes or {})[tm.ERROR_TYPE] == "RuntimeError"
    assert request.status.status_code is StatusCode.ERROR
    assert all(not s.events for s in spans)
    assert not [t for s in spans for t in span_texts(s) if "zebra" in t]


# --- parts --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("base_url", "name"),
    [
        ("https://api.anthropic.com", "anthropic"),
        ("https://API.OpenAI.com/", "openai"),
        ("https://my-resource.openai.azure.com/openai", "azure.ai.openai"),
        ("https://bedrock-runtime.us-east-1.amazonaws.com", "aws.bedrock"),
        ("https://bedrock.us-east-1.amazonaws.com", None),  # the control plane: no model calls
        ("https://s3.amazonaws.com", None),
        ("https://anthropic.internal.example.com", None),  # a proxy: do not guess
        ("http://127.0.0.1:9100", None),
    ],
)
def test_provider_name_only_from_hosts_that_say_it(base_url: str, name: str | None) -> None:
    assert tm.provider_name(base_url) == name


# --- without an SDK, and otel.configure (fresh interpreters: providers are set once) -------


def run_python(code: str, env: dict[str, str] | None = None) -> Any:
    """Run `code` in a fresh interpreter (no SDK installed yet); its last stdout line is JSON."""
    import os

    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**clean, **(env or {})},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_without_an_sdk_no_span_is_made_and_nothing_is_propagated() -> None:
    result = run_python(
        """
        import asyncio, json
        import httpx
        from opentelemetry import trace
        from starlette.applications import Starlette
        from starlette.routing import Route
        from switchyard_mw.telemetry import names as tm
        from switchyard_mw.asgi.stack import switchyard_stack
        from switchyard_mw.config import parse_config
        from switchyard_mw.gateway import WIRE_ROUTES, Forwarder
        from switchyard_mw.testing import MockProvider

        CONFIG = '''
        [llm_clients.a]
        base_url = "http://mock.test"
        models = ["m"]
        '''
        seen = []

        class Spy(httpx.AsyncBaseTransport):
            def __init__(self, inner):
                self.inner = inner
            async def handle_async_request(self, request):
                seen.append(trace.get_current_span() is trace.INVALID_SPAN)
                return await self.inner.handle_async_request(request)

        async def main():
            mock = MockProvider()
            upstream = httpx.AsyncClient(transport=Spy(httpx.ASGITransport(app=mock)))
            app = Starlette(routes=[Route(p, Forwarder(upstream).forward, methods=["POST"])
                                    for p in WIRE_ROUTES])
            stack = switchyard_stack(app, config=parse_config(CONFIG), environ={})
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=stack),
                                         base_url="http://gw.test") as client:
                body = {"model": "m", "max_tokens": 5,
                        "messages": [{"role": "user", "content": "hi"}]}
                headers = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
                reply = await client.post("/v1/messages", json=body)
                passed = await client.post("/v1/messages", json=body, headers=headers)
            return {
                "tracing": tm.tracing(),
                "status": [reply.status_code, passed.status_code],
                "no_span_current": seen,
                "traceparent": [r.headers.get("traceparent") for r in mock.requests],
            }

        print(json.dumps(asyncio.run(main())))
        """
    )
    assert result["tracing"] is False
    assert result["status"] == [200, 200]
    assert result["no_span_current"] == [True, True]
    # None injected; a caller's own traceparent passes through untouched, as any header does.
    assert result["traceparent"] == [
        None,
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    ]


CONFIGURE = """
    import json
    from opentelemetry import metrics, trace
    from switchyard_mw.telemetry import otel
    {before}
    first = otel.configure(service_name="from-code")
    again = otel.configure(service_name="ignored")
    provider = trace.get_tracer_provider()
    resource = getattr(provider, "resource", None)
    print(json.dumps({{
        "first": [first.traces, list(first.metrics)],
        "same": again is first,
        "tracer": type(provider).__name__,
        "meter": type(metrics.get_meter_provider()).__name__,
        "service": resource.attributes.get("service.name") if resource else None,
    }}))
"""


def test_configure_with_an_endpoint_installs_otlp_and_prometheus_once() -> None:
    result = run_python(
        CONFIGURE.format(before=""), {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}
    )
    assert result == {
        "first": ["otlp", ["prometheus", "otlp"]],
        "same": True,
        "tracer": "TracerProvider",
        "meter": "MeterProvider",
        "service": "from-code",
    }


def test_configure_without_an_endpoint_leaves_tracing_off() -> None:
    result = run_python(CONFIGURE.format(before=""), {"OTEL_SERVICE_NAME": "from-env"})
    assert result["first"] == ["off", ["prometheus"]]
    assert result["tracer"] == "ProxyTracerProvider"  # spans stay the API's no-op


def test_configure_never_replaces_the_applications_providers() -> None:
    before = (
        "from opentelemetry.sdk.trace import TracerProvider\n"
        "    from opentelemetry.sdk.metrics import MeterProvider\n"
        "    trace.set_tracer_provider(TracerProvider())\n"
        "    metrics.set_meter_provider(MeterProvider())"
    )
    result = run_python(
        CONFIGURE.format(before=before),
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_SERVICE_NAME": "from-env"},
    )
    assert result["first"] == ["existing", ["existing"]]
    assert result["service"] == "from-env"  # the application's own provider, untouched


def test_configure_service_name_from_the_environment_wins() -> None:
    result = run_python(
        CONFIGURE.format(before=""),
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_SERVICE_NAME": "from-env"},
    )
    assert result["service"] == "from-env"


def test_configure_refuses_an_unknown_protocol() -> None:
    code = """
        import json
        from switchyard_mw.telemetry import otel
        from switchyard_mw.errors import StartupError
        try:
            otel.configure()
        except StartupError as exc:
            print(json.dumps(str(exc)))
    """
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_EXPORTER_OTLP_PROTOCOL": "x"}
    assert "OTEL_EXPORTER_OTLP_PROTOCOL" in run_python(code, env)


def test_variant_assignments_are_exported_as_exact_cumulative_counts(
    otel_metrics: Metrics,
) -> None:
    """The tally behind `switchyard.variant.assignments` loses no count, from any thread, and
    reaches a reader as a monotonic sum with the counter's attributes."""
    import threading

    from opentelemetry.sdk.metrics.export import Sum

    name = tm.VARIANT_ASSIGNMENTS
    before = otel_metrics.value(
        name, **{tm.REQUEST_MODEL: "tally-m", tm.VARIANT: "tally-v"}, key="user"
    )

    def count() -> None:
        for _ in range(5_000):
            tm.variant_assignments.add("tally-m", "tally-v", "user")

    threads = [threading.Thread(target=count) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    tm.variant_assignments.add("tally-m", "tally-other", "first_turn")
    after = otel_metrics.value(
        name, **{tm.REQUEST_MODEL: "tally-m", tm.VARIANT: "tally-v"}, key="user"
    )
    assert after - before == 20_000
    assert otel_metrics.value(name, **{tm.VARIANT: "tally-other"}, key="first_turn") >= 1
    data = otel_metrics._reader.get_metrics_data()
    assert data is not None
    kinds = {
        (type(metric.data), getattr(metric.data, "is_monotonic", None))
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for metric in sm.metrics
        if metric.name == name
    }
    assert kinds == {(Sum, True)}


async def test_each_attempt_has_a_genai_client_span(
    gw: Gateway, otel_spans: InMemorySpanExporter
) -> None:
    gw.mock.set_behaviour(ENV["KEY_A"], Behaviour(status=500))
    async with gw.client() as client:
        reply = await client.post("/v1/messages", json=MESSAGE, headers={"x-api-key": CALLER_KEY})
    assert reply.status_code == 200
    spans = otel_spans.get_finished_spans()
    attempts = named(spans, tm.SPAN_ATTEMPT)
    chats = [s for s in spans if s.name.startswith("chat ")]
    assert len(chats) == len(attempts) == 2
    for attempt, chat in zip(attempts, sorted(chats, key=lambda s: s.start_time or 0), strict=True):
        assert attempt.context is not None
        assert parent_of(chat) == attempt.context.span_id
        assert chat.kind is SpanKind.CLIENT
        attributes = dict(chat.attributes or {})
        assert attributes[tm.OPERATION_NAME] == "chat"
        assert attributes[tm.REQUEST_MODEL] == chat.name.removeprefix("chat ")
        assert attributes[tm.RESPONSE_MODEL] == attributes[tm.REQUEST_MODEL]
        assert attributes[tm.REQUEST_MAX_TOKENS] == MESSAGE["max_tokens"]
    failed, served = sorted(chats, key=lambda s: s.start_time or 0)
    assert dict(failed.attributes or {})[tm.ERROR_TYPE] == "500"
    assert tm.ERROR_TYPE not in dict(served.attributes or {})
    assert tm.USAGE_OUTPUT_TOKENS in dict(served.attributes or {})
