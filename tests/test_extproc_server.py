"""The ext_proc server over real gRPC: health, large bodies, graceful stop, listen parsing, CLI."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import msgspec
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc_helpers import request_body, request_headers, sets
from switchyard_mw import cli
from switchyard_mw.clients import build_clients
from switchyard_mw.config import parse_config
from switchyard_mw.extproc import ExtProcServer, Policies, parse_listen, start_server
from switchyard_mw.testing import Behaviour, MockProvider

CONFIG = """
[llm_clients.a]
base_url = "https://prov.example"
api_key_env = "KEY_A"
models = ["m", "slow-route-model"]
envoy_cluster = "prov"

[llm_clients.j]
base_url = "http://judge"
models = ["jm"]

[routes.slow]
classifier = "llm"
judge = "j"
judge_model = "jm"
judge_deadline_ms = 5000
choices = { x = "m" }
fallback = "m"
"""


@pytest.fixture
async def served() -> AsyncIterator[tuple[ExtProcServer, MockProvider, grpc.aio.Channel]]:
    mock = MockProvider()
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=mock))
    config = parse_config(CONFIG)
    policies = Policies(config, build_clients(config, {"KEY_A": "ka"}), judge_http_client=http)
    server = await start_server(policies, "127.0.0.1:0")
    channel = grpc.aio.insecure_channel(
        f"127.0.0.1:{server.port}", options=[("grpc.max_receive_message_length", 64 << 20)]
    )
    yield server, mock, channel
    await channel.close()
    await server.stop(grace_secs=0)
    await http.aclose()


async def exchange(
    channel: grpc.aio.Channel, *requests: ep.ProcessingRequest
) -> list[ep.ProcessingResponse]:
    stub = ep_grpc.ExternalProcessorStub(channel)

    async def send() -> AsyncIterator[ep.ProcessingRequest]:
        for request in requests:
            yield request

    return [answer async for answer in stub.Process(send())]


async def test_health_says_serving(served: tuple[ExtProcServer, MockProvider, grpc.aio.Channel]):
    _, _, channel = served
    stub = health_pb2_grpc.HealthStub(channel)
    for service in ("", "envoy.service.ext_proc.v3.ExternalProcessor"):
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_a_body_over_grpcs_default_4_mib_limit_round_trips(
    served: tuple[ExtProcServer, MockProvider, grpc.aio.Channel],
) -> None:
    _, _, channel = served
    text = "x" * (6 << 20)
    body = msgspec.json.encode({"model": "m", "messages": [{"role": "user", "content": text}]})
    answers = await exchange(channel, request_headers(), request_body(body))
    assert len(answers) == 2
    assert sets(answers[1])["x-switchyard-cluster"] == b"prov"


async def test_stop_lets_a_stream_in_flight_finish(
    served: tuple[ExtProcServer, MockProvider, grpc.aio.Channel],
) -> None:
    server, mock, channel = served
    mock.set_behaviour("*", Behaviour(headers_delay_secs=0.5, reply="x"))  # a slow judge
    body = msgspec.json.encode({"model": "slow", "messages": [{"role": "user", "content": "q"}]})
    in_flight = asyncio.create_task(exchange(channel, request_headers(), request_body(body)))
    await asyncio.sleep(0.2)  # the judge is being consulted
    stopping = asyncio.create_task(server.stop(grace_secs=5))
    answers = await in_flight
    await stopping
    assert len(answers) == 2
    assert sets(answers[1])["x-switchyard-cluster"] == b"prov"
    with pytest.raises(grpc.aio.AioRpcError):
        await exchange(channel, request_headers())


@pytest.mark.parametrize("good", ["127.0.0.1:50051", "[::1]:0", "unix:/tmp/sy.sock"])
def test_listen_addresses(good: str) -> None:
    assert parse_listen(good) == good


@pytest.mark.parametrize("bad", ["50051", "127.0.0.1:", "host:port", "unix:", ":80"])
def test_bad_listen_addresses(bad: str) -> None:
    with pytest.raises(ValueError, match=r"expected|socket path"):
        parse_listen(bad)


async def test_a_unix_socket_listener(tmp_path: Path) -> None:
    config = parse_config(CONFIG)
    socket_path = tmp_path / "extproc.sock"
    server = await start_server(
        Policies(config, build_clients(config, {"KEY_A": "ka"})), f"unix:{socket_path}"
    )
    try:
        assert server.port is None
        async with grpc.aio.insecure_channel(f"unix:{socket_path}") as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(grace_secs=0)


def test_the_cli_refuses_a_bad_config_with_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[routes.auto]\nclassifier = "llm"\n')
    err = io.StringIO()
    assert cli.run_extproc(str(bad), "127.0.0.1:0", err=err) == 2
    assert "routes.auto.judge: required" in err.getvalue()
    assert cli.run_extproc(str(bad), "nowhere", err=io.StringIO()) == 2


def test_the_cli_names_a_missing_key_with_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    good = tmp_path / "good.toml"
    good.write_text(CONFIG)
    monkeypatch.delenv("KEY_A", raising=False)
    err = io.StringIO()
    assert cli.run_extproc(str(good), "127.0.0.1:0", err=err) == 2
    assert "KEY_A" in err.getvalue()


def test_the_cli_serves_until_sigterm_and_exits_cleanly(tmp_path: Path) -> None:
    import os
    import signal
    import subprocess
    import sys

    config = tmp_path / "sy.toml"
    config.write_text(CONFIG)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "switchyard_mw.cli",
            "extproc",
            "--config",
            str(config),
            "--listen",
            "127.0.0.1:0",
        ],
        env={**os.environ, "KEY_A": "ka"},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert line.startswith("switchyard-mw extproc listening on 127.0.0.1:")
        assert not line.rstrip().endswith(":0")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
