"""`switchyard-mw extproc --workers N`: processes sharing one port, stopped together."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc  # type: ignore[import-untyped]  # grpcio ships no type hints
import msgspec
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc_helpers import request_body, request_headers, sets
from switchyard_mw import cli
from switchyard_mw._protos.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from switchyard_mw.accounts import build_accounts
from switchyard_mw.config import parse_config
from switchyard_mw.extproc import Policies, Transport, start_server

pytestmark = pytest.mark.integration  # starts real servers

CONFIG = """
[llm_clients.a]
base_url = "https://prov.example"
api_key_env = "KEY_A"
models = ["m"]
envoy_cluster = "prov"
"""


def children(pid: int) -> set[int]:
    """Live descendants of `pid` (from /proc)."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                kids = {int(c) for c in (task / "children").read_text().split()}
            except OSError:
                continue
            todo.extend(kids - found)
            found |= kids
    return found


@pytest.fixture
def served(tmp_path: Path, transport: str) -> Iterator[tuple[subprocess.Popen[str], int]]:
    config = tmp_path / "sy.toml"
    config.write_text(CONFIG)
    command = [sys.executable, "-m", "switchyard_mw.cli", "extproc", "--config", str(config)]
    proc = subprocess.Popen(
        [*command, "--listen", "127.0.0.1:0", "--workers", "2", "--transport", transport],
        env={**os.environ, "KEY_A": "ka"},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert line.startswith("switchyard-mw extproc listening on 127.0.0.1:"), line
        assert line.rstrip().endswith("(2 workers)")
        yield proc, int(line.split("127.0.0.1:")[1].split()[0])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_two_workers_serve_one_port_and_stop_cleanly(
    served: tuple[subprocess.Popen[str], int],
) -> None:
    proc, port = served
    workers = children(proc.pid)
    listening = subprocess.run(
        ["ss", "-Hltnp", f"sport = :{port}"], capture_output=True, text=True, check=False
    ).stdout
    pids = {int(part.split(",")[0]) for part in listening.split("pid=")[1:]}
    assert len(pids) == 2  # two processes, one port
    assert pids <= workers

    payload = msgspec.json.encode({"model": "m", "messages": [{"role": "user", "content": "q"}]})
    # Separate channels are separate connections, which the kernel spreads over the workers.
    for _ in range(6):
        with grpc.insecure_channel(
            f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)]
        ) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            stub = ep_grpc.ExternalProcessorStub(channel)
            answers = list(stub.Process(iter([request_headers(), request_body(payload)])))
            assert sets(answers[1])["x-switchyard-cluster"] == b"prov"

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)  # no worker left behind


def test_a_bad_worker_count_or_address_is_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "sy.toml"
    config.write_text(CONFIG)
    err = io.StringIO()
    assert cli.run_extproc(str(config), "127.0.0.1:0", err=err, workers=0) == 2
    assert "--workers 0" in err.getvalue()
    monkeypatch.setenv("KEY_A", "ka")
    err = io.StringIO()
    assert cli.run_extproc(str(config), f"unix:{tmp_path / 's.sock'}", err=err, workers=2) == 2
    assert "HOST:PORT" in err.getvalue()


def test_a_missing_key_is_named_once_with_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "sy.toml"
    config.write_text(CONFIG)
    monkeypatch.delenv("KEY_A", raising=False)
    err = io.StringIO()
    assert cli.run_extproc(str(config), "127.0.0.1:0", err=err, workers=2) == 2
    assert err.getvalue().count("KEY_A") == 1


async def test_one_processor_does_not_silently_share_a_port_another_serves(
    transport: Transport,
) -> None:
    """Without --workers, a port already served is an error, not a second listener that
    would take half of Envoy's connections (and half of its requests' failover)."""
    config = parse_config(CONFIG)
    first = await start_server(
        Policies(config, build_accounts(config, {"KEY_A": "ka"})),
        "127.0.0.1:0",
        transport=transport,
    )
    try:
        assert first.port is not None
        with pytest.raises(OSError, match="cannot listen"):
            await start_server(
                Policies(config, build_accounts(config, {"KEY_A": "ka"})),
                f"127.0.0.1:{first.port}",
                transport=transport,
            )
    finally:
        await first.stop(grace_secs=0)
