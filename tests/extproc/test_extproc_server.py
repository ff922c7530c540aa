"""The ext_proc server over real gRPC: health, large bodies, graceful stop, listen parsing, CLI."""

from __future__ import annotations

import asyncio
import io
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import msgspec
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc_helpers import request_body, request_headers, sets
from switchyard_mw import cli
from switchyard_mw._protos.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from switchyard_mw._protos.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from switchyard_mw.accounts import build_accounts
from switchyard_mw.config import parse_config
from switchyard_mw.extproc import ExtProcServer, Policies, Transport, parse_listen, start_server
from switchyard_mw.extproc import servicer as servicer_module
from switchyard_mw.extproc.h2_transport import PROCESS_PATH
from switchyard_mw.extproc.router import RouterStream
from switchyard_mw.testing import Behaviour, MockProvider

pytestmark = pytest.mark.integration  # starts real servers

PROCESS = PROCESS_PATH.decode()
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
async def served(
    transport: Transport,
) -> AsyncIterator[tuple[ExtProcServer, MockProvider, grpc.aio.Channel]]:
    mock = MockProvider()
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=mock))
    config = parse_config(CONFIG)
    policies = Policies(config, build_accounts(config, {"KEY_A": "ka"}), judge_http_client=http)
    server = await start_server(policies, "127.0.0.1:0", transport=transport)
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


@pytest.mark.parametrize("transport", ["frames", "h2"])
def test_the_server_serves_in_an_apps_uvloop_loop(transport: Transport) -> None:
    """`start_server` in an application's uvloop loop (what uvicorn runs with
    `uvicorn[standard]`), whose transports are no `asyncio.Transport` subclasses."""
    import uvloop

    loop = uvloop.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    mock = MockProvider()
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=mock))
    config = parse_config(CONFIG)
    policies = Policies(config, build_accounts(config, {"KEY_A": "ka"}), judge_http_client=http)
    started = start_server(policies, "127.0.0.1:0", transport=transport)
    server = asyncio.run_coroutine_threadsafe(started, loop).result(10)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            reply = check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            body = msgspec.json.encode(
                {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            )
            process = ep_grpc.ExternalProcessorStub(channel).Process
            answers = list(process(iter([request_headers(), request_body(body)]), timeout=10))
        assert len(answers) == 2
        assert sets(answers[1])["x-switchyard-cluster"] == b"prov"
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(grace_secs=0), loop).result(10)
        asyncio.run_coroutine_threadsafe(http.aclose(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


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


async def test_a_rewritten_body_larger_than_the_clients_window_arrives_whole(
    transport: Transport,
) -> None:
    """The answer is sent as the client opens its window (grpcio's starts at 64 KiB)."""
    canaried = CONFIG.replace('models = ["m",', 'models = ["m", "m2",')
    config = parse_config(canaried + "\n[canaries.m]\nvariants = { m2 = 100 }\n")
    server = await start_server(
        Policies(config, build_accounts(config, {"KEY_A": "ka"})),
        "127.0.0.1:0",
        transport=transport,
    )
    text = "é" * (3 << 20)  # 6 MiB of UTF-8
    body = msgspec.json.encode({"model": "m", "messages": [{"role": "user", "content": text}]})
    try:
        options = [("grpc.max_receive_message_length", 64 << 20)]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=options) as ch:
            answers = await asyncio.gather(
                *(exchange(ch, request_headers(), request_body(body)) for _ in range(3))
            )
        for answer in answers:
            rewritten = msgspec.json.decode(answer[1].request_body.response.body_mutation.body)
            assert rewritten["model"] == "m2"
            assert rewritten["messages"][0]["content"] == text
    finally:
        await server.stop(grace_secs=0)


async def test_many_streams_on_one_connection_leave_nothing_behind(
    served: tuple[ExtProcServer, MockProvider, grpc.aio.Channel],
) -> None:
    server, _, channel = served
    body = msgspec.json.encode({"model": "m", "messages": [{"role": "user", "content": "q"}]})
    for _ in range(200):
        answers = await exchange(channel, request_headers(), request_body(body))
        assert sets(answers[1])["x-switchyard-cluster"] == b"prov"
    assert len(server.servicer.flights) == 0
    if server.transport != "grpcio":  # and the transport's own bookkeeping is back to empty
        (connection,) = server_connections(server)
        assert connection.streams == {}
        assert len(connection.core.h2.streams) <= 2  # h2 prunes closed streams as new ones open


def server_connections(server: ExtProcServer) -> list[Any]:
    h2 = server._stop.__self__  # type: ignore[attr-defined]  # the bound H2Server.stop
    return list(h2.connections)


async def test_an_unknown_method_is_unimplemented(
    served: tuple[ExtProcServer, MockProvider, grpc.aio.Channel],
) -> None:
    _, _, channel = served
    call = channel.unary_unary("/envoy.service.ext_proc.v3.ExternalProcessor/Nope")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call(b"")
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_health_of_an_unknown_service_is_not_found(
    served: tuple[ExtProcServer, MockProvider, grpc.aio.Channel],
) -> None:
    _, _, channel = served
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="x"))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_health_watch_sees_not_serving_when_the_server_stops(
    served: tuple[ExtProcServer, MockProvider, grpc.aio.Channel],
) -> None:
    server, _, channel = served
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
    first = await watch.read()
    assert first.status == health_pb2.HealthCheckResponse.SERVING
    stopping = asyncio.create_task(server.stop(grace_secs=1))
    second = await asyncio.wait_for(watch.read(), 5)
    assert second.status == health_pb2.HealthCheckResponse.NOT_SERVING
    watch.cancel()
    await stopping


async def test_a_message_over_the_limit_is_refused_and_the_server_serves_on(
    transport: Transport,
) -> None:
    config = parse_config(CONFIG + "\n[server]\nmax_body_bytes = 1024\n")
    server = await start_server(
        Policies(config, build_accounts(config, {"KEY_A": "ka"})),
        "127.0.0.1:0",
        transport=transport,
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            huge = request_body(b"x" * (2 << 20))  # over the body limit and its 1 MiB slack
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await exchange(channel, request_headers(), huge)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            body = msgspec.json.encode(
                {"model": "m", "messages": [{"role": "user", "content": "q"}]}
            )
            answers = await exchange(channel, request_headers(), request_body(body))
            assert sets(answers[1])["x-switchyard-cluster"] == b"prov"
    finally:
        await server.stop(grace_secs=0)


async def test_a_stream_whose_handling_fails_is_unknown_and_is_released(
    served: tuple[ExtProcServer, MockProvider, grpc.aio.Channel],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, _, channel = served
    closed: list[RouterStream] = []

    class Failing(RouterStream):
        def on_request_headers(self, http: ep.HttpHeaders) -> ep.ProcessingResponse:
            raise RuntimeError("böom: 100% ✗")

        def close(self) -> None:
            closed.append(self)
            super().close()

    monkeypatch.setattr(servicer_module, "RouterStream", Failing)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await exchange(channel, request_headers())
    assert caught.value.code() == grpc.StatusCode.UNKNOWN
    assert "böom: 100% ✗" in (caught.value.details() or "")  # percent-encoded on the wire
    assert len(closed) == 1
    monkeypatch.undo()
    assert len(await exchange(channel, request_headers())) == 1


async def test_a_stream_the_client_cancels_mid_judge_is_released(
    served: tuple[ExtProcServer, MockProvider, grpc.aio.Channel],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, mock, channel = served
    mock.set_behaviour("*", Behaviour(headers_delay_secs=5, reply="x"))  # the judge stalls
    closed: list[RouterStream] = []

    class Recorded(RouterStream):
        def close(self) -> None:
            closed.append(self)
            super().close()

    monkeypatch.setattr(servicer_module, "RouterStream", Recorded)
    body = msgspec.json.encode({"model": "slow", "messages": [{"role": "user", "content": "q"}]})
    requests = asyncio.Queue[ep.ProcessingRequest]()

    async def send() -> AsyncIterator[ep.ProcessingRequest]:
        while True:
            yield await requests.get()

    call = ep_grpc.ExternalProcessorStub(channel).Process(send())
    await requests.put(request_headers())
    await call.read()
    await requests.put(request_body(body))
    await asyncio.sleep(0.3)  # the judge is being consulted
    assert closed == []
    call.cancel()
    for _ in range(100):
        if closed:
            break
        await asyncio.sleep(0.02)
    assert len(closed) == 1


async def test_stop_ends_what_outlasts_the_grace(
    served: tuple[ExtProcServer, MockProvider, grpc.aio.Channel],
) -> None:
    server, mock, channel = served
    mock.set_behaviour("*", Behaviour(headers_delay_secs=10, reply="x"))
    body = msgspec.json.encode({"model": "slow", "messages": [{"role": "user", "content": "q"}]})
    in_flight = asyncio.create_task(exchange(channel, request_headers(), request_body(body)))
    await asyncio.sleep(0.3)
    await asyncio.wait_for(server.stop(grace_secs=0.3), 5)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await asyncio.wait_for(in_flight, 5)
    assert caught.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


@pytest.mark.parametrize("engine", ["h2", "frames"])
async def test_h2_answers_a_non_grpc_request_with_415_and_garbage_with_a_close(
    engine: Transport,
) -> None:
    config = parse_config(CONFIG)
    server = await start_server(
        Policies(config, build_accounts(config, {"KEY_A": "ka"})), "127.0.0.1:0", transport=engine
    )
    try:
        async with httpx.AsyncClient(http1=False, http2=True) as client:
            reply = await client.post(
                f"http://127.0.0.1:{server.port}{PROCESS}",
                content=b"{}",
                headers={"content-type": "application/json"},
            )
        assert reply.status_code == 415
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        said = await asyncio.wait_for(reader.read(), 5)  # returns: the server closed it
        assert not said.startswith(b"HTTP/1")
        writer.close()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest()
            )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(grace_secs=0)


@pytest.mark.parametrize("good", ["127.0.0.1:50051", "[::1]:0", "unix:/tmp/sy.sock"])
def test_listen_addresses(good: str) -> None:
    assert parse_listen(good) == good


@pytest.mark.parametrize("bad", ["50051", "127.0.0.1:", "host:port", "unix:", ":80"])
def test_bad_listen_addresses(bad: str) -> None:
    with pytest.raises(ValueError, match=r"expected|socket path"):
        parse_listen(bad)


async def test_a_unix_socket_listener(tmp_path: Path, transport: Transport) -> None:
    config = parse_config(CONFIG)
    socket_path = tmp_path / "extproc.sock"
    server = await start_server(
        Policies(config, build_accounts(config, {"KEY_A": "ka"})),
        f"unix:{socket_path}",
        transport=transport,
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


def test_the_cli_serves_until_sigterm_and_exits_cleanly(tmp_path: Path, transport: str) -> None:
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
            "--transport",
            transport,
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


async def test_frames_is_the_default_transport_and_the_others_are_chosen_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = parse_config(CONFIG)
    server = await start_server(
        Policies(config, build_accounts(config, {"KEY_A": "ka"})), "127.0.0.1:0"
    )
    try:
        assert server.transport == "frames"
    finally:
        await server.stop(grace_secs=0)
    good = tmp_path / "good.toml"
    good.write_text(CONFIG)
    chosen: list[str] = []
    monkeypatch.setattr(
        cli, "run_extproc", lambda *_, transport, **__: chosen.append(transport) or 0
    )
    cli.main(["extproc", "--config", str(good)])
    cli.main(["extproc", "--config", str(good), "--transport", "grpcio"])
    cli.main(["extproc", "--config", str(good), "--transport", "h2"])
    assert chosen == ["frames", "grpcio", "h2"]


async def test_an_unknown_transport_is_refused_by_name(tmp_path: Path) -> None:
    config = parse_config(CONFIG)
    policies = Policies(config, build_accounts(config, {"KEY_A": "ka"}))
    with pytest.raises(ValueError, match="transport 'grpc': expected one of grpcio, h2"):
        await start_server(policies, "127.0.0.1:0", transport="grpc")  # type: ignore[arg-type]
    good = tmp_path / "good.toml"
    good.write_text(CONFIG)
    with pytest.raises(SystemExit) as exited:
        cli.main(["extproc", "--config", str(good), "--transport", "grpc"])
    assert exited.value.code == 2  # argparse names the choices on stderr


def test_the_grpcio_limits_become_grpcs_own_options(monkeypatch: pytest.MonkeyPatch) -> None:
    from switchyard_mw.extproc import GrpcioLimits
    from switchyard_mw.extproc import server as server_module

    monkeypatch.setattr(server_module.resource, "getrlimit", lambda _: (1024, 4096))
    options = dict(GrpcioLimits(age_grace_secs=1.5).options(33 << 20, reuse_port=False))
    assert options["grpc.max_receive_message_length"] == 33 << 20
    assert options["grpc.max_concurrent_streams"] == 1000
    assert options["grpc.max_allowed_incoming_connections"] == 512  # half the fd limit
    assert options["grpc.absolute_max_metadata_size"] == 16 << 10
    assert options["grpc.max_connection_idle_ms"] == 60_000
    assert options["grpc.max_connection_age_grace_ms"] == 1500
    assert options["grpc.server_handshake_timeout_ms"] == 10_000
    explicit = dict(GrpcioLimits(max_connections=7).options(1, reuse_port=True))
    assert explicit["grpc.max_allowed_incoming_connections"] == 7
    assert explicit["grpc.so_reuseport"] == 1
