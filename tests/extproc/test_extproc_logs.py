"""The decision records of the ext_proc front carry the request's id (Envoy's `x-request-id`),
whichever of the request's streams makes them; `switchyard-mw extproc --log-format json`
writes every line as one JSON object, the records of its workers too."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, TextIO

import grpc
import msgspec
import pytest

from extproc_helpers import Stream, request_body, request_headers, response_headers, sets
from switchyard_mw._protos.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from switchyard_mw._protos.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from switchyard_mw.accounts import build_accounts
from switchyard_mw.config import parse_config
from switchyard_mw.extproc import ExtProcServicer, Policies
from switchyard_mw.telemetry import logs

CONFIG = """
[llm_clients.a]
base_url = "https://prov.example"
api_key_env = "KEY_A"
models = ["m"]
failure_threshold = 1
envoy_cluster = "prov"

[llm_clients.b]
base_url = "https://prov.example"
api_key_env = "KEY_B"
models = ["m"]
priority = 1
failure_threshold = 1
envoy_cluster = "prov"
"""
ENV = {"KEY_A": "ka", "KEY_B": "kb"}
BODY = msgspec.json.encode(
    {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
)
UPSTREAM = [("x-switchyard-filter", "upstream")]


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def events(self, name: str) -> list[dict[str, Any]]:
        return [r.__dict__ for r in self.records if r.__dict__.get("event") == name]


@pytest.fixture
def records() -> Iterator[Records]:
    handler = Records()
    root = logging.getLogger(logs.ROOT)
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


class OwnContext:
    """A stream driven as the h2 transport drives one: every message in the stream's own
    `contextvars.Context`, apart from the test's and from the other streams'."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.context = contextvars.copy_context()

    async def send(self, request: ep.ProcessingRequest) -> ep.ProcessingResponse:
        loop = asyncio.get_running_loop()
        return await loop.create_task(self.stream.send(request), context=self.context)

    async def close(self) -> None:
        await asyncio.get_running_loop().create_task(self.stream.close(), context=self.context)


@pytest.fixture
def servicer() -> ExtProcServicer:
    config = parse_config(CONFIG)
    return ExtProcServicer(Policies(config, build_accounts(config, ENV)))


async def test_a_router_level_record_carries_envoys_request_id(
    servicer: ExtProcServicer, records: Records
) -> None:
    router = OwnContext(Stream(servicer))
    await router.send(request_headers(extra={"x-request-id": "envoy-rid-1"}))
    await router.send(request_body(BODY))
    await router.send(response_headers(503, details="via_upstream"))
    await router.close()
    (cooled,) = records.events("account.cooled")
    assert (cooled["account"], cooled["request_id"]) == ("a", "envoy-rid-1")


async def test_an_upstream_level_record_carries_the_requests_id(
    servicer: ExtProcServicer, records: Records
) -> None:
    """The refusal is recorded by the upstream-level filter's stream, which finds the request
    by the `request.id` attribute: its record names the request too."""
    router = OwnContext(Stream(servicer))
    await router.send(request_headers())  # x-request-id: rid-1, as Envoy sets it
    await router.send(request_body(BODY))
    refused = OwnContext(Stream(servicer, UPSTREAM))
    retry = await refused.send(response_headers(401, request_id="rid-1"))
    assert sets(retry) == {"x-switchyard-retry": b"1"}
    await refused.close()
    (cooled,) = records.events("account.cooled")
    assert (cooled["account"], cooled["cause"], cooled["request_id"]) == (
        "a",
        "credentials",
        "rid-1",
    )
    await router.send(response_headers(200, details="via_upstream"))
    await router.close()


async def test_an_unsafe_request_id_is_replaced(
    servicer: ExtProcServicer, records: Records
) -> None:
    router = OwnContext(Stream(servicer))
    await router.send(request_headers(extra={"x-request-id": "forged\nERROR x"}))
    await router.send(request_body(BODY))
    await router.send(response_headers(503, details="via_upstream"))
    await router.close()
    (cooled,) = records.events("account.cooled")
    assert len(cooled["request_id"]) == 16
    assert "\n" not in cooled["request_id"]


# --- the command ------------------------------------------------------------------------------


def _json_lines(stream: TextIO, until: str, lines: list[dict[str, Any]], timeout: float) -> None:
    """Read JSON lines into `lines` until one whose event is `until` (each must parse)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        line = stream.readline()
        if not line:
            break
        lines.append(json.loads(line))
        if lines[-1].get("event") == until:
            return
    pytest.fail(f"no {until} record in {lines}")


@pytest.mark.integration
@pytest.mark.parametrize("workers", ["1", "2"])
def test_the_command_logs_json_lines(tmp_path: Path, transport: str, workers: str) -> None:
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
            "--workers",
            workers,
            "--log-format",
            "json",
        ],
        env={**os.environ, **ENV},
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[dict[str, Any]] = []
    try:
        assert proc.stderr is not None
        _json_lines(proc.stderr, "extproc.listening", lines, 60)
        listening = lines[-1]
        assert listening["workers"] == int(workers)
        assert listening["logger"] == "switchyard_mw.extproc"
        port = int(listening["listen"].rpartition(":")[2])
        assert port > 0

        async def one_request() -> None:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = ep_grpc.ExternalProcessorStub(channel)

                async def messages() -> AsyncIterator[ep.ProcessingRequest]:
                    yield request_headers(extra={"x-request-id": "envoy-rid-42"})
                    yield request_body(BODY)
                    yield response_headers(503, details="via_upstream")

                answers = [answer async for answer in stub.Process(messages())]
                assert len(answers) == 3

        asyncio.run(one_request())
        _json_lines(proc.stderr, "account.cooled", lines, 30)
        cooled = lines[-1]
        assert (cooled["level"], cooled["logger"]) == ("WARNING", "switchyard_mw.accounts")
        assert (cooled["account"], cooled["request_id"]) == ("a", "envoy-rid-42")
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
        rest = proc.stderr.read()
        for line in rest.splitlines():  # whatever came after, JSON too
            json.loads(line)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process `pid` has a handler for `sig` (Linux: /proc/PID/status, SigCgt)."""
    with contextlib.suppress(FileNotFoundError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


@pytest.mark.integration
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_sighup_while_it_starts_does_not_end_it(tmp_path: Path, workers: str) -> None:
    """SIGHUPs from the moment the command handles one until it listens: it listens, and
    (one process) reads its config again once it serves."""
    config, log = tmp_path / "sy.toml", tmp_path / "extproc.log"
    config.write_text(CONFIG)
    argv = ["--config", str(config), "--listen", "127.0.0.1:0", "--workers", workers]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "switchyard_mw.cli", "extproc", *argv],
            env={**os.environ, **ENV},
            stderr=out,
        )
    try:
        end = time.monotonic() + 60
        while not _catches(proc.pid, signal.SIGHUP) and time.monotonic() < end:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.005)
        sent = 0
        while "listening on" not in log.read_text() and time.monotonic() < end:
            assert proc.poll() is None, log.read_text()
            proc.send_signal(signal.SIGHUP)
            sent += 1
            time.sleep(0.05)
        assert sent > 1, log.read_text()  # some came while it started
        assert proc.poll() is None, log.read_text()
        if workers == "1":
            while "config reloaded" not in log.read_text() and time.monotonic() < end:
                time.sleep(0.05)
            assert "config reloaded result=ok" in log.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
