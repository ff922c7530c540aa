"""An account (and a pair) whose cooling ran out with no request since, as a running gateway
shows it: `/switchyard/accounts` and `switchyard_account_state` on `/metrics` read cooled (2)
while the period runs and half-open (1, `probe_due: true`) after it, with no request sent.

The example gateway runs as a user runs it (uvicorn, subprocess) beside the mock provider;
with `[state] backend = "redis"` (a real `redis-server`), the fault goes through one gateway
and a second one, which never gets a request, is the one read.
"""

from __future__ import annotations

import textwrap
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from redis_server import RedisServer, running_redis
from servers import example_gateway, metric_value, serve_in_thread
from switchyard_mw.testing import Behaviour, MockProvider

pytestmark = pytest.mark.integration  # starts real servers

PERIOD = 5.0  # long enough to read the cooled state on a loaded machine, short for a test
KEYS = {"KEY_SOLO": "solo-key", "KEY_DUAL": "dual-key"}


@pytest.fixture
def mock() -> Iterator[tuple[MockProvider, str]]:
    provider = MockProvider()
    provider.set_behaviour("solo-key", Behaviour(status=503))
    provider.set_behaviour("dual-key", Behaviour(status=503))
    with serve_in_thread(provider) as url:
        yield provider, url


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    yield from running_redis(tmp_path)


def config(mock_url: str, state: str) -> str:
    """`solo` serves one model (a 5xx cools the account); `dual` serves two (a 5xx cools
    its pair for the model asked)."""
    accounts = ""
    for name, models in (("solo", '["ho-solo"]'), ("dual", '["ho-dual", "ho-other"]')):
        accounts += f"""
        [llm_clients.{name}]
        base_url = "{mock_url}"
        api_key_env = "KEY_{name.upper()}"
        auth = "x-api-key"
        models = {models}
        failure_threshold = 1
        cooldown_secs = {PERIOD}
        """
    return textwrap.dedent(state) + textwrap.dedent(accounts)


def ask(gateway: str, model: str) -> int:
    body = {"model": model, "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(base_url=gateway, timeout=10) as client:
        return client.post("/v1/messages", json=body, headers={"x-api-key": "caller"}).status_code


def breakers(gateway: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """`solo`'s own breaker and `dual`'s pair for "ho-dual", as /switchyard/accounts shows."""
    accounts = {
        a["name"]: a for a in httpx.get(f"{gateway}/switchyard/accounts").json()["accounts"]
    }
    return accounts["solo"], accounts["dual"]["models"].get("ho-dual", {})


def gauges(gateway: str) -> tuple[float, float]:
    """`switchyard_account_state` of `solo`, and of `dual` for "ho-dual"."""
    solo = metric_value(gateway, "switchyard_account_state", switchyard_account="solo")
    pair = metric_value(
        gateway,
        "switchyard_account_state",
        switchyard_account="dual",
        gen_ai_response_model="ho-dual",
    )
    return solo, pair


def shown(gateway: str, state: str, within: float = 5.0) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both breakers once the page shows them in `state` (a replica learns a cooling through
    Redis in milliseconds; one still connecting learns it when it connects)."""
    end = time.monotonic() + within
    while True:
        solo, pair = breakers(gateway)
        if solo["state"] == pair.get("state") == state:
            return solo, pair
        assert time.monotonic() < end, (solo, pair)
        time.sleep(0.02)


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_the_page_and_the_gauge_read_half_open_after_the_period_with_no_traffic(
    backend: str,
    mock: tuple[MockProvider, str],
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    provider, url = mock
    state = ""
    if backend == "redis":
        redis: RedisServer = request.getfixturevalue("redis_server")
        state = f'[state]\nbackend = "redis"\nurl = "{redis.url}"\nkey_prefix = "half-open"\n'
    text = config(url, state)
    with ExitStack() as stack:
        (tmp_path / "a").mkdir()
        sender = stack.enter_context(example_gateway(text, tmp_path / "a", KEYS))
        reader = sender
        if backend == "redis":
            (tmp_path / "b").mkdir()
            reader = stack.enter_context(example_gateway(text, tmp_path / "b", KEYS))
        started = time.monotonic()
        assert ask(sender, "ho-solo") == 503
        assert ask(sender, "ho-dual") == 503
        cooled_at = time.monotonic()

        solo, pair = shown(reader, "cooled")
        assert time.monotonic() - started < PERIOD, "read too late to see the cooling"
        for breaker in (solo, pair):
            assert breaker["probe_due"] is False
            assert 0 < breaker["cooled_for_secs"] <= PERIOD
        assert gauges(reader) == (2.0, 2.0)

        sent = len(provider.requests)
        time.sleep(max(0.0, cooled_at + PERIOD - time.monotonic()) + 0.2)
        solo, pair = shown(reader, "half_open", within=1.0)
        for breaker in (solo, pair):
            assert breaker["probe_due"] is True
            assert breaker["probe_in_flight"] is False
            assert breaker["cooled_for_secs"] is None
            assert breaker["cause"] == "outage"
        assert gauges(reader) == (1.0, 1.0)
        # Nothing went upstream meanwhile: the period's end alone made them half-open.
        assert len(provider.requests) == sent == 2
        # The next request is the probe: it goes upstream, and its fault cools `solo` again.
        assert ask(reader, "ho-solo") == 503
        assert len(provider.requests) == 3
        solo, pair = breakers(reader)
        assert (solo["state"], solo["probe_due"]) == ("cooled", False)
        assert (pair["state"], pair["probe_due"]) == ("half_open", True)
