"""Two ext_proc processors with `[state] backend = "redis"` share one cooling state, and the
throttle holds in force, also with one that starts after the hold."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from extproc_helpers import Stream, request_body, request_headers, response_headers, sets
from redis_server import RedisServer, running_redis
from switchyard_mw.accounts import build_accounts
from switchyard_mw.config import parse_config
from switchyard_mw.core.pool import BreakerState
from switchyard_mw.extproc import ExtProcServicer, Policies

pytestmark = pytest.mark.integration  # starts real servers

CONFIG = """
[state]
backend = "redis"
url = "{url}"
key_prefix = "extproc-test"

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
envoy_cluster = "prov"
"""
KEYS = {"KEY_A": "ka", "KEY_B": "kb"}
BODY = b'{"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}'


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    yield from running_redis(tmp_path)


async def routed_to(
    servicer: ExtProcServicer, status: int, headers: dict[str, str] | None = None
) -> bytes:
    """One request through one processor; the account's key it set, after `status` came back."""
    stream = Stream(servicer)
    await stream.send(request_headers())
    answer = await stream.send(request_body(BODY))
    key = sets(answer)["authorization"]
    await stream.send(response_headers(status, headers))
    await stream.close()
    return key


async def test_a_cooling_in_one_processor_reroutes_the_other(redis_server: RedisServer) -> None:
    config = parse_config(CONFIG.format(url=redis_server.url))
    one, two = (Policies(config, build_accounts(config, KEYS)) for _ in range(2))
    await one.start()
    await two.start()
    try:
        assert await routed_to(ExtProcServicer(one), 401) == b"Bearer ka"  # refused: cools a
        end = time.monotonic() + 1.0
        while two.pool.status_of("a").state is not BreakerState.COOLED:
            assert time.monotonic() < end, "the other processor never heard of the cooling"
            await asyncio.sleep(0.005)
        # The second processor sends its next request straight to b.
        assert await routed_to(ExtProcServicer(two), 200) == b"Bearer kb"
    finally:
        await one.aclose()
        await two.aclose()


async def test_a_processor_started_after_a_hold_skips_the_held_account(
    redis_server: RedisServer,
) -> None:
    config = parse_config(CONFIG.format(url=redis_server.url))
    one = Policies(config, build_accounts(config, KEYS))
    await one.start()
    late: Policies | None = None
    try:
        # a answers 429 "retry in 30 s": held for m, everywhere.
        assert await routed_to(ExtProcServicer(one), 429, {"retry-after": "30"}) == b"Bearer ka"
        end = time.monotonic() + 1.0
        while not one.pool.holds_of("a"):
            assert time.monotonic() < end, "no hold"
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.2)  # written to Redis in the background
        late = Policies(config, build_accounts(config, KEYS))  # e.g. a pod scaled up now
        await late.start()
        end = time.monotonic() + 2.0
        while not late.pool.holds_of("a"):
            assert time.monotonic() < end, "the late processor never learnt the hold"
            await asyncio.sleep(0.005)
        assert 25 < late.pool.holds_of("a")["m"] - late.pool.clock() <= 30
        assert await routed_to(ExtProcServicer(late), 200) == b"Bearer kb"
    finally:
        await one.aclose()
        if late is not None:
            await late.aclose()
