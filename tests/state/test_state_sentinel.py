"""Shared state behind Sentinel (one master, one replica, three sentinels on loopback): two
example gateways under uvicorn follow the replica the sentinels promote, without a restart;
holds and trips in force survive the failover and reach a replica that starts after it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from test_state_cluster import (
    account,
    ask,
    assert_kept,
    gateway_config,
    tries,
    two_gateways,
    wait_until,
)
from test_state_held import Replica, specs, started

from redis_server import SentinelGroup, running_sentinels, until
from servers import serve_in_thread
from switchyard_mw.state.redis_store import RedisStore
from switchyard_mw.testing import Behaviour, MockProvider

pytestmark = pytest.mark.integration


@pytest.fixture
def sentinels(tmp_path: Path) -> Iterator[SentinelGroup]:
    yield from running_sentinels(tmp_path / "redis")


@pytest.fixture
def mock() -> Iterator[tuple[MockProvider, str]]:
    provider = MockProvider()
    with serve_in_thread(provider) as url:
        yield provider, url


def test_two_gateways_follow_the_promoted_replica(
    sentinels: SentinelGroup, mock: tuple[MockProvider, str], tmp_path: Path
) -> None:
    provider, url = mock
    provider.set_behaviour("kx", Behaviour(status=401))
    provider.set_behaviour("kp", Behaviour(status=401))
    listed = ", ".join(f'"{address}"' for address in sentinels.sentinels)
    state = f"""
    [state]
    backend = "redis"
    mode = "sentinel"
    sentinels = [{listed}]
    service = "{sentinels.service}"
    key_prefix = "sen"
    """
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    with two_gateways(gateway_config(url, state), tmp_path) as (a, b):
        assert ask(a).status_code == 200
        wait_until(lambda: account(b, "x")["state"] == "cooled", 5, "b never saw x cooled")
        replica = redis.Redis(port=sentinels.replica.port, decode_responses=True)
        with replica:
            wait_until(lambda: replica.hget("sen:account:{x}", "faults") == "1", 5, "no copy")
            copy = replica.hgetall("sen:account:{x}")

        # The master dies; the sentinels promote the replica; both gateways keep answering.
        sentinels.master.kill()
        answered = 0
        end = time.monotonic() + 30
        while sentinels.master_port() != sentinels.replica.port:
            assert time.monotonic() < end, "the sentinels promoted nobody"
            for gateway in (a, b) * 5:
                assert ask(gateway).status_code == 200
                answered += 1
        print(f"{answered} requests answered during the failover")

        promoted = redis.Redis(port=sentinels.replica.port, decode_responses=True)
        with promoted:
            assert_kept(promoted.hgetall("sen:account:{x}"), copy)  # type: ignore[arg-type]
        # The gateways follow the new master, without a restart: y refused on b reaches a.
        provider.set_behaviour("ky", Behaviour(status=401))
        before = tries(provider, "ky")
        wait_until(lambda: _cools(b, "y"), 15, "y never cooled on b")
        wait_until(lambda: account(a, "y")["state"] == "cooled", 15, "a never heard of y")
        for gateway in (a, b) * 3:
            assert ask(gateway).headers["x-switchyard-account"] == "good"
        assert tries(provider, "ky") == before + 1
        assert tries(provider, "kx") == 1


def _cools(gateway: str, name: str) -> bool:
    ask(gateway)
    return account(gateway, name)["state"] == "cooled"


async def test_holds_and_trips_in_force_outlive_a_failover(sentinels: SentinelGroup) -> None:
    """Kept on the master, copied to its replica, read from it once promoted by a replica
    that starts after the failover."""
    addresses = [("127.0.0.1", port) for port in sentinels.sentinel_ports]
    stores: list[RedisStore] = []

    async def replica() -> Replica:
        store = RedisStore(
            None, mode="sentinel", sentinels=addresses, key_prefix="held", reconnect_max_secs=0.2
        )
        stores.append(store)
        return await started(store, *specs("x", "y"))

    try:
        a = await replica()
        held_at = time.monotonic()
        a.hold("x", "m", 60.0)
        a.canaries.trip("base", "var-a")
        copy = redis.Redis(port=sentinels.replica.port, decode_responses=True)
        with copy:
            # (polled without blocking the event loop the store writes from)
            await until(lambda: copy.zcard("held:holds:{x}") == 1 and copy.hlen("held:trips") == 1)
        sentinels.master.kill()
        end = time.monotonic() + 30
        while sentinels.master_port() != sentinels.replica.port:
            assert time.monotonic() < end, "the sentinels promoted nobody"
            await asyncio.sleep(0.1)

        late = await replica()
        left = 60 - (time.monotonic() - held_at)
        assert left - 1 < late.held_for("x", "m") <= left + 0.05
        assert late.held_for("y", "m") == 0
        assert late.canaries.tripped("base", "var-a")
    finally:
        for store in stores:
            await store.aclose()
