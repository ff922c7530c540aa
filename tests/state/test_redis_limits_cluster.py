"""Tenants' limits on a Redis Cluster (3 masters, 3 replicas on loopback): one tenant's keys in
one slot, so its limits reserve in one script; with the deployment's `[[limits]]` too, two
scripts (two slots), and what one granted is given back when the other refuses."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest
import redis
from redis.crc import key_slot

from redis_server import RedisCluster, running_cluster
from switchyard_mw.core.limits import Granted, LimitKey, Measure, Refused
from switchyard_mw.state.redis_limits import RedisLimits, limit_key

pytestmark = pytest.mark.integration

DAY = LimitKey(scope="team-a", measure=Measure.TOKENS, per="day", amount=1000)
OPUS = LimitKey(scope="team-a", measure=Measure.TOKENS, per="minute", amount=500, model="opus")
FLEET = LimitKey(scope="", measure=Measure.TOKENS, per="hour", amount=300, model="opus")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    yield from running_cluster(tmp_path_factory.mktemp("cluster"))


@pytest.fixture
async def limits(cluster: RedisCluster) -> AsyncIterator[RedisLimits]:
    store = RedisLimits(cluster.url, mode="cluster", key_prefix="c", timeout_secs=1.0)
    yield store
    await store.aclose()


def script_calls(cluster: RedisCluster) -> int:
    total = 0
    for node in cluster.running():
        stats = node.info("commandstats")
        for name in ("cmdstat_evalsha", "cmdstat_eval"):
            if name in stats:
                total += int(dict(f.split("=") for f in stats[name].split(","))["calls"])
    return total


def held(cluster: RedisCluster, key: LimitKey) -> float:
    client = redis.RedisCluster.from_url(cluster.url, decode_responses=True)
    try:
        return float(client.hget(limit_key("c", key), "n") or 0)  # type: ignore[arg-type]
    finally:
        client.close()


async def test_one_tenants_keys_share_a_slot_and_reserve_in_one_script(
    cluster: RedisCluster, limits: RedisLimits
) -> None:
    assert key_slot(limit_key("c", DAY).encode()) == key_slot(limit_key("c", OPUS).encode())
    warm = await limits.reserve({DAY: 1, FLEET: 1})  # each script loaded on both masters
    assert isinstance(warm, Granted)
    await limits.release(warm.reservation)
    before = script_calls(cluster)
    granted = await limits.reserve({DAY: 100, OPUS: 100})
    assert isinstance(granted, Granted)
    assert script_calls(cluster) - before == 1
    await limits.settle(granted.reservation, {Measure.TOKENS: 40})
    assert script_calls(cluster) - before == 2
    assert held(cluster, DAY) == 40
    assert held(cluster, OPUS) == 40


async def test_with_the_deployments_limits_two_scripts_and_a_refusal_gives_back_the_other_half(
    cluster: RedisCluster, limits: RedisLimits
) -> None:
    assert key_slot(limit_key("c", DAY).encode()) != key_slot(limit_key("c", FLEET).encode())
    day_before, fleet_before = held(cluster, DAY), held(cluster, FLEET)
    before = script_calls(cluster)
    granted = await limits.reserve({DAY: 200, FLEET: 200})
    assert isinstance(granted, Granted)
    assert script_calls(cluster) - before == 2  # one per slot, side by side
    assert set(granted.statuses) == {DAY, FLEET}
    # FLEET cannot take 200 more: the tenant's half is given back (a third call).
    refused = await limits.reserve({DAY: 200, FLEET: 200})
    assert isinstance(refused, Refused)
    assert refused.limit == FLEET
    for _ in range(100):
        if held(cluster, DAY) == day_before + 200:
            break
        await asyncio.sleep(0.01)
    assert held(cluster, DAY) == day_before + 200
    assert held(cluster, FLEET) == fleet_before + 200
    await limits.release(granted.reservation)
    assert (held(cluster, DAY), held(cluster, FLEET)) == (day_before, fleet_before)
