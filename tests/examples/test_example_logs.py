"""The example's log: `python examples/starlette_app.py` with `LOG_FORMAT=json` writes one JSON
object per line, the gateway's decisions and uvicorn's lines alike, while the mock it runs in
process logs to its own file (a reset it was told to play ends there in a traceback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from servers import ROOT, free_port, wait_for_port

pytestmark = pytest.mark.integration


def test_the_mock_logs_apart_and_the_gateway_in_json(tmp_path: Path) -> None:
    port, mock_port = free_port(), free_port()
    mock_log, log = tmp_path / "mock.log", tmp_path / "example.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SWITCHYARD_", "MOCK_"))}
    env |= {
        "PORT": str(port),
        "SWITCHYARD_MOCK_PORT": str(mock_port),
        "SWITCHYARD_MOCK_LOG": str(mock_log),
        "LOG_FORMAT": "json",
    }
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "examples/starlette_app.py"],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for_port(port)
        wait_for_port(mock_port)
        behaviours = f"http://127.0.0.1:{mock_port}/_mock/behaviours/mock-key-a"
        httpx.put(behaviours, json={"fail": "reset_before_headers"}).raise_for_status()
        for _ in range(3):  # three resets cool mock-a (failure_threshold = 3); b answers each
            answer = httpx.post(
                f"http://127.0.0.1:{port}/v1/messages",
                headers={"x-api-key": "anything"},
                json={
                    "model": "claude-opus-5",
                    "max_tokens": 8,
                    "messages": [{"role": "user", "content": "hi"}],
                },
                timeout=30,
            )
            assert answer.status_code == 200
            assert answer.headers["x-switchyard-account"] == "mock-b"
        end = time.monotonic() + 10
        while "account.cooled" not in log.read_text() and time.monotonic() < end:
            time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(20)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    (cooled,) = [r for r in records if r.get("event") == "account.cooled"]
    assert (cooled["account"], cooled["model"]) == ("mock-a", "claude-opus-5")
    assert any(r["logger"] == "uvicorn.access" for r in records)
    assert not any("exception" in r for r in records)  # no traceback in the gateway's log
    assert "Traceback" not in log.read_text()
    # The mock's own records, its tracebacks included, are in its file.
    assert "Traceback (most recent call last)" in mock_log.read_text()
    assert "MockProviderFault" in mock_log.read_text()
