"""The shared hedge budget on a real Redis: replicas draw on one budget."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from redis_server import RedisServer, running_redis
from switchyard_mw import switchyard_stack
from switchyard_mw.config import parse_config
from switchyard_mw.core.hedge_budget import HedgeVerdict
from switchyard_mw.state.redis_hedge_budget import SharedHedgeBudget

pytestmark = pytest.mark.integration  # starts a real redis-server


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    yield from running_redis(tmp_path)


@pytest.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    c = aioredis.Redis.from_url(redis_server.url)
    yield c
    await c.aclose()


def replica(
    client: aioredis.Redis, *, window_secs: float = 60.0, model: str = "m"
) -> SharedHedgeBudget:
    return SharedHedgeBudget(
        client, key_prefix="t:", model=model, max_ratio=0.05, window_secs=window_secs, buckets=4
    )


@pytest.mark.parametrize(
    ("requests", "hedges_allowed"), [(19, 0), (20, 1), (40, 2), (59, 2), (60, 3)]
)
async def test_two_replicas_share_one_budget(
    client: aioredis.Redis, requests: int, hedges_allowed: int
) -> None:
    a, b = replica(client), replica(client)
    for i in range(requests):
        await (a if i % 2 else b).note_request()
    verdicts = [await (a if i % 2 else b).try_hedge() for i in range(hedges_allowed + 2)]
    assert verdicts.count(HedgeVerdict.START) == hedges_allowed
    assert verdicts[hedges_allowed:] == [HedgeVerdict.REFUSED] * 2


async def test_models_have_budgets_of_their_own(client: aioredis.Redis) -> None:
    a, b = replica(client, model="a"), replica(client, model="b")
    for _ in range(20):
        await a.note_request()
    assert await b.try_hedge() is HedgeVerdict.REFUSED
    assert await a.try_hedge() is HedgeVerdict.START


async def test_the_window_slides_on_redis_time(client: aioredis.Redis) -> None:
    # Real time is the point here (Redis's clock): a 0.4 s window of 0.1 s buckets.
    a = replica(client, window_secs=0.4)
    for _ in range(20):
        await a.note_request()
    assert await a.try_hedge() is HedgeVerdict.START
    await asyncio.sleep(0.45)
    assert await a.try_hedge() is HedgeVerdict.REFUSED  # the 20 requests have left
    assert await client.exists("t:hedge:m") == 0  # their buckets were deleted as it passed
    await a.note_request()
    assert await client.hkeys("t:hedge:m") != []
    assert 0 < await client.pttl("t:hedge:m") <= 800  # two windows: a quiet model leaves


STACK_CONFIG = """
[state]
backend = "redis"
url = "{url}"
key_prefix = "hedge-stacks"

[llm_clients.a]
base_url = "http://a.test"
api_key_env = "K"
models = ["m"]
hedge_after_secs = 1

[llm_clients.b]
base_url = "http://b.test"
api_key_env = "K"
models = ["m"]
"""


async def _nothing(scope: object, receive: object, send: object) -> None:
    pass


async def test_two_stacks_draw_on_one_budget_through_their_store(
    redis_server: RedisServer,
) -> None:
    """20 requests seen by one replica earn the other its hedge: each alone would refuse."""
    config = parse_config(STACK_CONFIG.format(url=redis_server.url))
    one, two = (
        switchyard_stack(_nothing, config=config, environ={"K": "k"}, reload_on_signal=False)
        for _ in range(2)
    )
    try:
        for stack in (one, two):
            await stack.store.start()
            for _ in range(250):  # connected and subscribed, within 5 s
                if stack.store.healthy:  # type: ignore[attr-defined]
                    break
                await asyncio.sleep(0.02)
            assert stack.store.healthy  # type: ignore[attr-defined]
        first, second = one.engine.hedging, two.engine.hedging
        assert first is not None
        assert second is not None
        for _ in range(20):
            first.note_request("m")
        await first.noted()
        assert second.counts("m") == (0, 0)  # its own window saw nothing
        assert await second.may_start("m")
        assert not await second.may_start("m")
        assert not await first.may_start("m")
    finally:
        await one.aclose()
        await two.aclose()
