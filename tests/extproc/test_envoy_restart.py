"""The ext_proc processor restarts while Envoy serves: requests fail closed during the gap, and
flow again once the processor is back on its port, with no restart of Envoy.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from servers import ROOT, free_port, serve_in_thread
from switchyard_mw.accounts import build_accounts
from switchyard_mw.config import parse_config
from switchyard_mw.extproc import Policies, Transport, start_server
from switchyard_mw.testing import MockProvider
from switchyard_mw.testing.envoy import run_envoy, with_ports

pytestmark = pytest.mark.integration  # starts real servers

ENVOY_YAML = (ROOT / "examples" / "envoy" / "envoy.yaml").read_text()
CONFIG = """
[llm_clients.a]
base_url = "{mock}"
api_key_env = "KEY_A"
models = ["claude-haiku-5"]
envoy_cluster = "mock"
"""
REQUEST = {
    "model": "claude-haiku-5",
    "max_tokens": 20,
    "messages": [{"role": "user", "content": "hi"}],
}


@pytest.fixture
def mock() -> Iterator[tuple[MockProvider, str]]:
    provider = MockProvider()
    with serve_in_thread(provider) as url:
        yield provider, url


def policies(mock_url: str) -> Policies:
    config = parse_config(CONFIG.format(mock=mock_url))
    return Policies(config, build_accounts(config, {"KEY_A": "key-a"}))


async def test_processor_restart_while_envoy_serves(
    mock: tuple[MockProvider, str], tmp_path: Path, transport: Transport
) -> None:
    provider, mock_url = mock
    processor_port, listener = free_port(), free_port()
    ports = {
        "listener": listener,
        "admin": 0,
        "processor": processor_port,
        "upstream": int(mock_url.rsplit(":", 1)[1]),
        "otel": free_port(),
    }
    address = f"127.0.0.1:{processor_port}"
    processor = await start_server(policies(mock_url), address, transport=transport)
    with run_envoy(with_ports(ENVOY_YAML, ports), listen_port=listener) as envoy:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{listener}", timeout=10) as http:
            before = await http.post("/v1/messages", json=REQUEST)
            assert before.status_code == 200
            assert before.headers["x-switchyard-account"] == "a"

            await processor.stop(grace_secs=1)
            provider.clear_requests()
            during = await http.post("/v1/messages", json=REQUEST)
            assert during.status_code == 503  # failure_mode_allow: false: closed, not bypassed
            assert provider.requests == []  # nothing reached the provider unprocessed

            processor = await start_server(policies(mock_url), address, transport=transport)
            after = await http.post("/v1/messages", json=REQUEST)
            assert after.status_code == 200
            assert after.headers["x-switchyard-account"] == "a"
            assert [r.key for r in provider.requests] == ["key-a"]
        assert envoy.poll() is None  # Envoy itself never restarted
    await processor.stop(grace_secs=1)
    assert envoy.poll() is not None  # and it is gone after the block: nothing left behind
