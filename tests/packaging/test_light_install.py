"""What each install brings: `import switchyard_mw` stays light, a missing extra is named.

Each check runs in a fresh interpreter (what a module loads is only visible from a clean
`sys.modules`). An extra that is "not installed" is simulated by `sys.modules[name] = None`,
which makes every import of that module fail as a missing package does; `.ci/installs` checks
the same commands in real fresh virtualenvs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "switchyard.toml"

# Top-level modules that must not load with the middlewares (one per extra that brings them).
HEAVY = (
    "grpc",
    "grpc_health",
    "h2",
    "google.protobuf",
    "switchyard_mw._protos",
    "envoy",
    "aiohttp",
    "httpx_aiohttp",
    "opentelemetry.sdk",
    "opentelemetry.proto",
    "opentelemetry.exporter",
    "opentelemetry.instrumentation",
    "prometheus_client",
    "redis",
    "google.auth",
    "botocore",
)


def run_python(code: str, *, blocked: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """Run `code` in a fresh interpreter in which the `blocked` modules cannot be imported."""
    prelude = "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in blocked)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_SDK_DISABLED"):
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=ROOT,
    )


def loaded_heavy(code: str) -> list[str]:
    """The HEAVY modules (or their submodules) loaded once `code` ran."""
    probe = textwrap.dedent(code) + textwrap.dedent(f"""
        heavy = {HEAVY!r}
        print(sorted({{m for m in sys.modules for h in heavy if m == h or m.startswith(h + ".")}}))
    """)
    result = run_python(probe)
    assert result.returncode == 0, result.stderr
    return eval(result.stdout.strip().splitlines()[-1])  # a list literal we printed


def test_import_switchyard_mw_loads_no_grpc_protos_aiohttp_or_sdk() -> None:
    assert loaded_heavy("import switchyard_mw") == []


def test_the_public_names_load_no_extra_either() -> None:
    code = """
        import switchyard_mw
        for name in switchyard_mw.__all__:
            getattr(switchyard_mw, name)
        from switchyard_mw.telemetry import otel, prometheus, names as telemetry
        from switchyard_mw import state
    """
    assert loaded_heavy(code) == []


def test_the_stack_serves_a_request_with_no_extra_installed() -> None:
    # The base install: no aiohttp (the judge's client falls back to httpx's pool), no gRPC,
    # no OpenTelemetry SDK, no Prometheus, no redis.
    code = f"""
        import asyncio, os
        import httpx
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse
        from starlette.routing import Route
        import switchyard_mw
        from switchyard_mw import make_http_client
        from switchyard_mw.telemetry import otel, prometheus
        from switchyard_mw.clients.outbound import pool_of

        for var in ("MOCK_KEY_A", "MOCK_KEY_B", "MOCK_JUDGE_KEY"):
            os.environ[var] = "k"

        async def answer(request):
            ctx = switchyard_mw.current_context()
            return JSONResponse({{"model": ctx.resolved_model, "account": ctx.account.name}})

        async def main():
            app = switchyard_mw.switchyard_stack(
                Starlette(routes=[Route("/v1/messages", answer, methods=["POST"])]),
                config={str(CONFIG)!r},
            )
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                body = {{"model": "claude-haiku-5", "max_tokens": 8,
                         "messages": [{{"role": "user", "content": "hi"}}]}}
                response = await client.post("/v1/messages", json=body)
            await app.aclose()
            print(response.status_code, *response.json().values())

        asyncio.run(main())
        assert pool_of(make_http_client()) is None  # httpx's own pool, not aiohttp's
        assert otel.configure() == otel.Setup(traces="off", metrics=())
        assert prometheus.install() is False
        assert prometheus.render()[0] == 501
    """
    result = run_python(code, blocked=HEAVY)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["200", "claude-haiku-5", "mock-a"]


@pytest.mark.parametrize(
    ("module", "blocked", "extra"),
    [
        ("switchyard_mw.gateway", ("aiohttp",), "gateway"),
        ("switchyard_mw.gateway", ("httpx_aiohttp",), "gateway"),
        ("switchyard_mw.extproc", ("grpc",), "envoy"),
        ("switchyard_mw.extproc", ("h2",), "envoy"),
        ("switchyard_mw.extproc", ("google.protobuf",), "envoy"),
        ("switchyard_mw.clouds.google_token", ("google.auth",), "vertex"),
    ],
)
def test_a_feature_without_its_extra_names_the_extra(
    module: str, blocked: tuple[str, ...], extra: str
) -> None:
    code = f"""
        from switchyard_mw.errors import MissingExtraError
        try:
            import {module}
        except MissingExtraError as exc:
            print(exc.extra, "|", exc)
    """
    result = run_python(code, blocked=blocked)
    assert result.returncode == 0, result.stderr
    named, _, message = result.stdout.partition("|")
    assert named.strip() == extra
    assert f"pip install 'switchyard-mw[{extra}]'" in message


def test_the_extproc_command_without_the_envoy_extra_says_what_to_install() -> None:
    code = f"""
        from switchyard_mw import cli
        code = cli.main(["extproc", "--config", {str(CONFIG)!r}, "--listen", "127.0.0.1:0"])
        print("exit", code)
    """
    result = run_python(code, blocked=("grpc",))
    assert result.stdout.strip() == "exit 1"
    assert "pip install 'switchyard-mw[envoy]'" in result.stderr
    assert "Traceback" not in result.stderr


def test_an_otlp_endpoint_without_the_sdk_names_the_otlp_extra() -> None:
    code = """
        import os
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = "http://127.0.0.1:4318"
        from switchyard_mw.telemetry import otel
        from switchyard_mw.errors import StartupError
        try:
            otel.configure()
        except StartupError as exc:
            print(exc)
    """
    result = run_python(code, blocked=("opentelemetry.sdk",))
    assert result.returncode == 0, result.stderr
    assert "pip install 'switchyard-mw[otlp]'" in result.stdout


def test_the_otlp_exporter_and_the_envoy_protos_work_in_one_process() -> None:
    # Envoy's protos once came from a package that overwrote opentelemetry-proto's modules
    # with an old copy: the exporter then failed to import, or encoded with the wrong schema.
    code = """
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        from switchyard_mw._protos.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
        import switchyard_mw.extproc

        memory = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(memory))
        with provider.get_tracer("t").start_as_current_span("switchyard.attempt"):
            pass
        wire = encode_spans(memory.get_finished_spans()).SerializeToString()
        decoded = trace_service_pb2.ExportTraceServiceRequest.FromString(wire)
        print(decoded.resource_spans[0].scope_spans[0].spans[0].name)
        OTLPSpanExporter(endpoint="http://127.0.0.1:9/v1/traces")

        request = ep.ProcessingRequest(request_headers=ep.HttpHeaders(end_of_stream=True))
        print(ep.ProcessingRequest.FromString(request.SerializeToString()).WhichOneof("request"))
    """
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["switchyard.attempt", "request_headers"]


def test_the_otlp_exporter_missing_names_the_extra() -> None:
    from switchyard_mw.telemetry.otel import _missing

    exc = ImportError(
        "No module named 'opentelemetry.exporter.otlp'", name="opentelemetry.exporter.otlp"
    )
    assert "switchyard-mw[otlp]" in str(_missing(exc))
