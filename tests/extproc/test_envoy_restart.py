"""The ext_proc processor restarts while Envoy serves: requests fail closed during the gap, and
flow again once the processor is back on its port, with no restart of Envoy.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from envoy_rig import ENVOY_YAML, policies_of, port_of
from servers import free_port
from switchyard_mw.extproc import Policies, Transport, start_server
from switchyard_mw.testing import MockProvider
from switchyard_mw.testing.envoy import run_on_free_ports

pytestmark = pytest.mark.integration  # starts real servers

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


def policies(mock_url: str) -> Policies:
    return policies_of(CONFIG.format(mock=mock_url), {"KEY_A": "key-a"})


async def test_processor_restart_while_envoy_serves(
    mock_server: tuple[MockProvider, str], tmp_path: Path, transport: Transport
) -> None:
    provider, mock_url = mock_server
    port = free_port()
    address = f"127.0.0.1:{port}"
    processor = await start_server(policies(mock_url), address, transport=transport)
    with run_on_free_ports(ENVOY_YAML, processor=port, upstream=port_of(mock_url)) as envoy:
        async with httpx.AsyncClient(base_url=envoy.url, timeout=10) as http:
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
        assert envoy.process.poll() is None  # Envoy itself never restarted
    await processor.stop(grace_secs=1)
    assert envoy.process.poll() is not None  # and it is gone after the block: nothing left behind
