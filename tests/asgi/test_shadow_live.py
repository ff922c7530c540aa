"""Shadow traffic through the example gateway (uvicorn), the mock provider and the SDK."""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from servers import example_gateway, metric_value, serve_in_thread
from switchyard_mw.testing import Behaviour, MockProvider

pytestmark = pytest.mark.integration

CONFIG = """
[server]
shadow_max_inflight = {inflight}

[llm_clients.main]
base_url = "{mock}"
api_key_env = "KEY_MAIN"
auth = "x-api-key"
models = ["s-on", "s-off", "s-share"]

[llm_clients.shadow-acct]
base_url = "{mock}"
api_key_env = "KEY_SHADOW"
auth = "x-api-key"
models = ["s-shadow"]
failure_threshold = 1

[canaries."s-on"]
variants = {{}}
shadow = {{ "s-shadow" = 100.0 }}

[canaries."s-share"]
variants = {{}}
shadow = {{ "s-shadow" = 30.0 }}
"""
KEYS = {"KEY_MAIN": "key-main", "KEY_SHADOW": "key-shadow"}
TURN: Any = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def mock() -> Iterator[tuple[MockProvider, str]]:
    provider = MockProvider()
    with serve_in_thread(provider) as url:
        yield provider, url


@pytest.fixture
def gateway(
    mock: tuple[MockProvider, str], tmp_path: Any, request: pytest.FixtureRequest
) -> Iterator[str]:
    provider, url = mock
    provider.reset()
    inflight = getattr(request, "param", 64)
    config = CONFIG.format(mock=url, inflight=inflight)
    with example_gateway(config, tmp_path, KEYS) as gw:
        yield gw


async def timed(client: anthropic.AsyncAnthropic, model: str, user: str) -> float:
    started = time.perf_counter()
    answer = await client.messages.with_raw_response.create(
        model=model, max_tokens=8, messages=TURN, metadata={"user_id": user}
    )
    assert answer.http_response.status_code == 200
    assert answer.headers["x-switchyard-model"] == model  # the client's answer: never the shadow
    return time.perf_counter() - started


async def test_a_slow_shadow_never_slows_the_client(
    gateway: str, mock: tuple[MockProvider, str]
) -> None:
    provider, _ = mock
    provider.set_behaviour("key-shadow", Behaviour(headers_delay_secs=1.5))
    async with anthropic.AsyncAnthropic(base_url=gateway, api_key="caller", max_retries=0) as c:
        on, off = [], []
        for i in range(15):  # interleaved, so load on the machine hits both alike
            on.append(await timed(c, "s-on", f"u{i}"))
            off.append(await timed(c, "s-off", f"u{i}"))
    ratio = statistics.median(on) / statistics.median(off)
    assert ratio < 2.0, (ratio, on, off)  # each shadow takes 1.5 s: waiting would show 10x
    await asyncio.sleep(2.0)  # let the shadows finish
    shadows = [r for r in provider.requests if r.model == "s-shadow"]
    assert len(shadows) == 15
    # The copy carries the shadow account's own key, nothing of the caller's.
    assert {r.key for r in shadows} == {"key-shadow"}
    assert all("caller" not in str(r.headers) for r in shadows)
    shadow_count = metric_value(
        gateway, "gen_ai_client_operation_duration_seconds_count", switchyard_shadow="true"
    )
    assert shadow_count == 15


async def test_the_shadow_share_follows_its_percentage(
    gateway: str, mock: tuple[MockProvider, str]
) -> None:
    provider, _ = mock
    n, p = 200, 0.30
    async with anthropic.AsyncAnthropic(base_url=gateway, api_key="caller", max_retries=0) as c:
        await asyncio.gather(*(timed(c, "s-share", f"share-{i}") for i in range(n)))
    await asyncio.sleep(1.0)
    mirrored = sum(1 for r in provider.requests if r.model == "s-shadow")
    bound = 4 * math.sqrt(n * p * (1 - p))  # 4 standard deviations
    assert abs(mirrored - n * p) < bound, mirrored


async def test_a_failing_shadow_cools_nothing(gateway: str, mock: tuple[MockProvider, str]) -> None:
    provider, _ = mock
    provider.set_behaviour("key-shadow", Behaviour(status=500))
    async with anthropic.AsyncAnthropic(base_url=gateway, api_key="caller", max_retries=0) as c:
        for i in range(5):
            await timed(c, "s-on", f"fail-{i}")
    await asyncio.sleep(0.5)
    async with httpx.AsyncClient() as http:
        accounts = (await http.get(f"{gateway}/switchyard/accounts")).json()["accounts"]
    (shadow_acct,) = [a for a in accounts if a["name"] == "shadow-acct"]
    assert (shadow_acct["state"], shadow_acct["consecutive_faults"]) == ("closed", 0)
    failed = metric_value(
        gateway,
        "gen_ai_client_operation_duration_seconds_count",
        switchyard_shadow="true",
        error_type="500",
    )
    assert failed == 5


@pytest.mark.parametrize("gateway", [3], indirect=True)
async def test_past_the_inflight_bound_shadows_are_dropped_and_counted(
    gateway: str, mock: tuple[MockProvider, str]
) -> None:
    provider, _ = mock
    provider.set_behaviour("key-shadow", Behaviour(headers_delay_secs=3.0))
    async with anthropic.AsyncAnthropic(base_url=gateway, api_key="caller", max_retries=0) as c:
        await asyncio.gather(*(timed(c, "s-on", f"burst-{i}") for i in range(12)))
    dropped = metric_value(
        gateway, "switchyard_shadow_dropped_total", gen_ai_response_model="s-shadow"
    )
    await asyncio.sleep(0.3)
    started = sum(1 for r in provider.requests if r.model == "s-shadow")
    assert started <= 3
    assert dropped == 12 - started
