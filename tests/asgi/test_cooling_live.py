"""Cooling over real sockets: the example gateway, the mock provider, the official Anthropic SDK.

The mock runs under uvicorn on a thread of this process (so each test sets its behaviour
directly); the gateway runs as `uvicorn examples.starlette_app:app` in a subprocess, as a user
would run it. One gateway serves every case: each case has its own model, served by a refused
account (priority 0, its key scripted on the mock) and a good one (priority 1).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from servers import example_gateway, serve_in_thread
from switchyard_mw.testing import Behaviour, MockProvider

pytestmark = pytest.mark.integration  # starts real servers

CASES = (401, 402, 403, 503, 429)
MESSAGES: Any = [{"role": "user", "content": "Say hello"}]


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
    with serve_in_thread(provider) as url:
        yield provider, url


@pytest.fixture(scope="module")
def gateway(
    mock: tuple[MockProvider, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    with example_gateway(_config(mock[1]), tmp_path_factory.mktemp("cooling-live"), _keys()) as url:
        yield url


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


async def test_throttled_account_without_a_retry_time_is_tried_again(
    gateway: str, mock: tuple[MockProvider, str]
) -> None:
    provider, _ = mock
    # No retry time: nothing is held (with one, the account would sit out; see test_throttle).
    provider.set_behaviour("refused-429", Behaviour(status=429, headers={}))
    async with anthropic.AsyncAnthropic(base_url=gateway, api_key="x", max_retries=0) as client:
        first = await _create(client, 429)
        second = await _create(client, 429)
    for response in (first, second):
        assert response.status_code == 200
        assert response.headers["x-switchyard-attempts"] == "2"
        assert response.headers["x-switchyard-account"] == "good-429"
    throttled = _account(gateway, "refused-429")
    assert (throttled["state"], throttled["consecutive_faults"]) == ("closed", 0)
