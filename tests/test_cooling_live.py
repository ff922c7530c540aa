"""Cooling over real sockets: the example gateway, the mock provider, the official Anthropic SDK.

The mock runs under uvicorn on a thread of this process (so each test sets its behaviour
directly); the gateway runs as `uvicorn examples.starlette_app:app` in a subprocess, as a user
would run it. One gateway serves every case: each case has its own model, served by a refused
account (priority 0, its key scripted on the mock) and a good one (priority 1).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
import uvicorn

from switchyard_mw.testing import Behaviour, MockProvider

ROOT = Path(__file__).resolve().parents[1]
CASES = (401, 402, 403, 503, 429)
MESSAGES: Any = [{"role": "user", "content": "Say hello"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _wait_for(port: int, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port}")


def _config(mock_url: str) -> str:
    sections = []
    for status in CASES:
        for name, priority in ((f"refused-{status}", 0), (f"good-{status}", 1)):
            sections.append(f"""
[llm_clients.{name}]
base_url = "{mock_url}"
api_key_env = "KEY_{name.replace("-", "_").upper()}"
auth = "x-api-key"
models = ["claude-{status}"]
priority = {priority}
failure_threshold = 1
cooldown_secs = 300
""")
    return "".join(sections)


def _keys() -> dict[str, str]:
    """Key variables and values: the mock scripts each refused account by its key."""
    return {
        f"KEY_{kind.upper()}_{status}": f"{kind}-{status}"
        for status in CASES
        for kind in ("refused", "good")
    }


@pytest.fixture(scope="module")
def mock() -> Iterator[tuple[MockProvider, str]]:
    provider = MockProvider()
    port = _free_port()
    config = uvicorn.Config(
        provider, host="127.0.0.1", port=port, log_level="warning", lifespan="off"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="mock-provider", daemon=True)
    thread.start()
    try:
        _wait_for(port)
        yield provider, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def gateway(
    mock: tuple[MockProvider, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("cooling-live")
    config = tmp / "switchyard.toml"
    config.write_text(_config(mock[1]))
    port = _free_port()
    env = {**os.environ, **_keys(), "SWITCHYARD_CONFIG": str(config), "SWITCHYARD_START_MOCK": "0"}
    command = [sys.executable, "-m", "uvicorn", "examples.starlette_app:app"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    with (tmp / "gateway.log").open("wb") as log:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            try:
                _wait_for(port)
            except TimeoutError:
                raise RuntimeError((tmp / "gateway.log").read_text()) from None
            yield f"http://127.0.0.1:{port}"
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def _create(client: anthropic.AsyncAnthropic, status: int) -> Any:
    return await client.messages.with_raw_response.create(
        model=f"claude-{status}", max_tokens=32, messages=MESSAGES
    )


def _account(gateway: str, name: str) -> dict[str, Any]:
    accounts = httpx.get(f"{gateway}/switchyard/accounts").json()["accounts"]
    (found,) = [a for a in accounts if a["name"] == name]
    assert isinstance(found, dict)
    return found


@pytest.mark.parametrize("status", [401, 402, 403, 503])
async def test_refused_account_is_cooled_after_one_failover(
    status: int, gateway: str, mock: tuple[MockProvider, str]
) -> None:
    provider, _ = mock
    provider.set_behaviour(f"refused-{status}", Behaviour(status=status))
    async with anthropic.AsyncAnthropic(base_url=gateway, api_key="x", max_retries=0) as client:
        first = await _create(client, status)
        second = await _create(client, status)
    assert first.status_code == 200
    assert first.headers["x-switchyard-attempts"] == "2"
    assert first.headers["x-switchyard-account"] == f"good-{status}"
    message = await first.parse()
    assert message.model == f"claude-{status}"
    assert second.status_code == 200
    assert second.headers["x-switchyard-attempts"] == "1"
    assert second.headers["x-switchyard-account"] == f"good-{status}"
    keys = [r.key for r in provider.requests if r.model == f"claude-{status}"]
    assert keys == [f"refused-{status}", f"good-{status}", f"good-{status}"]
    refused = _account(gateway, f"refused-{status}")
    assert refused["state"] == "cooled"
    assert 0 < refused["cooled_for_secs"] <= 300


async def test_throttled_account_is_tried_again(
    gateway: str, mock: tuple[MockProvider, str]
) -> None:
    provider, _ = mock
    provider.set_behaviour("refused-429", Behaviour(status=429))
    async with anthropic.AsyncAnthropic(base_url=gateway, api_key="x", max_retries=0) as client:
        first = await _create(client, 429)
        second = await _create(client, 429)
    for response in (first, second):
        assert response.status_code == 200
        assert response.headers["x-switchyard-attempts"] == "2"
        assert response.headers["x-switchyard-account"] == "good-429"
    throttled = _account(gateway, "refused-429")
    assert (throttled["state"], throttled["consecutive_faults"]) == ("closed", 0)
