"""Shared cooling state on a real Redis: two pools in one process, each with its own store.

Each pool stands for a replica (its own connections, its own subscription); the live test
(`test_state_live.py`) does the same across processes.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from conftest import Metrics
from redis_server import RedisServer, running_redis, until
from switchyard_mw.core.pool import AccountPool, AccountSpec, BreakerState, Outcome
from switchyard_mw.core.shared import Cause, Change, Shared
from switchyard_mw.engine.claims import acquire_shared
from switchyard_mw.state.redis_store import RedisStore
from switchyard_mw.telemetry import names as tm

pytestmark = pytest.mark.integration  # starts real servers

Replica = tuple[AccountPool, RedisStore]
MakeReplica = Callable[..., Awaitable[Replica]]


def spec(name: str, **kw: object) -> AccountSpec:
    return AccountSpec(name=name, models=frozenset({"m"}), **kw)  # type: ignore[arg-type]


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    yield from running_redis(tmp_path)


@pytest.fixture
async def replica(redis_server: RedisServer) -> AsyncIterator[MakeReplica]:
    stores: list[RedisStore] = []

    async def make(*specs: AccountSpec, timeout_secs: float = 0.1, lease: float = 60.0) -> Replica:
        pool = AccountPool(specs)
        store = RedisStore(
            redis_server.url,
            key_prefix="t",
            timeout_secs=timeout_secs,
            probe_lease_secs=lease,
            reconnect_max_secs=0.2,
        )
        store.bind(pool)
        stores.append(store)
        await store.start()
        await until(lambda: store.healthy)
        return pool, store

    yield make
    for store in stores:
        await store.aclose()


def cooled(pool: AccountPool, name: str = "x") -> bool:
    return pool.status_of(name).state is BreakerState.COOLED


def cooled_for(pool: AccountPool, name: str = "x") -> float:
    until_ = pool.status_of(name).cooled_until
    assert until_ is not None
    return until_ - pool.clock()


async def fault(pool: AccountPool, name: str = "x") -> None:
    lease = await acquire_shared(pool, "m", allowed={name})
    assert lease is not None
    pool.record(lease, Outcome.FAULT)


async def test_a_cooling_is_shared_within_milliseconds(replica: MakeReplica) -> None:
    accounts = [spec(f"a{i}", failure_threshold=1, cooldown_secs=30.0) for i in range(20)]
    a, _ = await replica(*accounts)
    b, _ = await replica(*accounts)
    latencies = []
    for account in accounts:
        await fault(a, account.name)
        assert cooled(a, account.name)
        latencies.append(await until(lambda n=account.name: cooled(b, n)))  # type: ignore[misc]
    assert 29 < cooled_for(b, "a0") <= 30
    print(f"propagation: median {statistics.median(latencies) * 1000:.2f} ms, "
          f"max {max(latencies) * 1000:.2f} ms")  # fmt: skip
    assert max(latencies) < 0.25


async def test_consecutive_faults_add_up_across_replicas(replica: MakeReplica) -> None:
    a, _ = await replica(spec("x", failure_threshold=3), spec("y", priority=1))
    b, _ = await replica(spec("x", failure_threshold=3), spec("y", priority=1))
    await fault(a)
    await until(lambda: b.status_of("x").consecutive_faults == 1)
    await fault(b)
    await until(lambda: a.status_of("x").consecutive_faults == 2)
    await fault(a)  # the third fault in a row, though each replica saw at most two itself
    await until(lambda: cooled(a) and cooled(b))


async def test_a_success_after_faults_resets_the_shared_count(replica: MakeReplica) -> None:
    a, _ = await replica(spec("x", failure_threshold=3))
    b, _ = await replica(spec("x", failure_threshold=3))
    await fault(a)
    await fault(a)
    await until(lambda: b.status_of("x").consecutive_faults == 2)
    lease = await acquire_shared(b, "m")
    assert lease is not None
    b.record(lease, Outcome.SUCCESS)
    await until(lambda: a.status_of("x").consecutive_faults == 0)
    await fault(a)
    await asyncio.sleep(0.05)
    assert not cooled(a)
    assert not cooled(b)


async def test_a_shorter_second_cooling_leaves_the_longer_one(replica: MakeReplica) -> None:
    # Two replicas on different cooldowns (a config rollout half done) fault at once.
    a, store_a = await replica(spec("x", failure_threshold=1, cooldown_secs=60.0))
    b, store_b = await replica(
        spec("x", failure_threshold=1, cooldown_secs=1.0, max_cooldown_secs=1)
    )
    await asyncio.gather(fault(b), fault(a))
    await until(lambda: cooled_for(b) > 50)
    assert cooled_for(a) > 59
    # A replica with a stale view reports a 1 s cooling while 60 s are in force.
    store_b.changed("x", Change.FAULT, Shared(1, 1.0, 1.0))
    await asyncio.sleep(0.1)
    shared = await store_a.snapshot("x")
    assert shared.cooled_for_secs is not None
    assert shared.cooled_for_secs > 59
    assert cooled_for(a) > 59
    assert cooled_for(b) > 59


async def test_exactly_one_probe_across_replicas(
    replica: MakeReplica, redis_server: RedisServer
) -> None:
    accounts = (spec("x", failure_threshold=1, cooldown_secs=0.3), spec("y", priority=1))
    a, _ = await replica(*accounts)
    b, _ = await replica(*accounts)
    await fault(a)
    await until(lambda: cooled(b))
    await asyncio.sleep(0.35)  # the cooling is over on both: each would probe on its own
    leases = await asyncio.gather(*(acquire_shared(pool, "m") for pool in (a, b) * 25))
    probes = [
        (pool, lease)
        for pool, lease in zip((a, b) * 25, leases, strict=True)
        if lease and lease.probe
    ]
    assert len(probes) == 1, probes
    assert {lease.account for lease in leases if lease and not lease.probe} == {"y"}
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        assert 0 < await client.pttl("t:probe:{x}") <= 60_000
        pool, lease = probes[0]
        other = b if pool is a else a
        assert other.status_of("x").probe_in_flight
        pool.record(lease, Outcome.SUCCESS)
        await until(lambda: other.status_of("x").state is BreakerState.CLOSED)
        assert await client.exists("t:probe:{x}") == 0
    finally:
        await client.aclose()


@pytest.mark.parametrize(
    ("cooldown", "max_cooldown", "wait", "cause", "period"),
    [
        (0.2, 0.4, 0.45, Cause.OUTAGE, 0.4),  # an outage older than max_cooldown_secs: doubled
        # A young outage: the same period again (a second: room for the message under load).
        (1.0, 10.0, 1.05, Cause.OUTAGE, 1.0),
        (0.2, 10.0, 0.25, Cause.CREDENTIALS, 0.4),  # a refused key: doubled at once
    ],
)
async def test_a_failed_probe_recools_everywhere_with_the_period_the_outage_age_says(
    replica: MakeReplica,
    cooldown: float,
    max_cooldown: float,
    wait: float,
    cause: Cause,
    period: float,
) -> None:
    accounts = (
        spec("x", failure_threshold=1, cooldown_secs=cooldown, max_cooldown_secs=max_cooldown),
    )
    a, _ = await replica(*accounts)
    b, _ = await replica(*accounts)
    await fault(a)
    await asyncio.sleep(wait)
    probe = await acquire_shared(b, "m")
    assert probe is not None
    assert probe.probe
    assert await acquire_shared(a, "m") is None  # b holds the probe: a neither probes nor serves
    assert a.retry_after_secs("m") == 1.0
    b.record(probe, Outcome.FAULT, cause)
    # The new cooling, not the first fault's: that one has run out (half-open), and for a
    # young outage its period is the same, so only its end tells them apart.
    await until(
        lambda: cooled(a) and cooled_for(a) > 0 and a.status_of("x").current_cooldown_secs == period
    )
    assert period / 2 < cooled_for(a) <= period
    assert not a.status_of("x").probe_in_flight


async def test_a_released_probe_frees_the_slot_for_every_replica(replica: MakeReplica) -> None:
    accounts = (spec("x", failure_threshold=1, cooldown_secs=0.2),)
    a, _ = await replica(*accounts)
    b, _ = await replica(*accounts)
    await fault(a)
    await asyncio.sleep(0.25)
    probe = await acquire_shared(a, "m")
    assert probe is not None
    assert probe.probe
    await until(lambda: b.status_of("x").probe_in_flight)
    a.release(probe)  # the client left: no verdict on the account
    await until(lambda: not b.status_of("x").probe_in_flight)
    again = await acquire_shared(b, "m")
    assert again is not None
    assert again.probe


async def test_a_healthy_account_costs_no_round_trip(
    replica: MakeReplica, redis_server: RedisServer
) -> None:
    pool, _ = await replica(spec("x"), spec("y"))
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        before = (await client.info("stats"))["total_commands_processed"]
        for _ in range(1000):
            lease = await acquire_shared(pool, "m")
            assert lease is not None
            pool.record(lease, Outcome.SUCCESS)
        after = (await client.info("stats"))["total_commands_processed"]
    finally:
        await client.aclose()
    assert after - before == 1  # the second INFO itself


async def test_redis_killed_then_back_local_state_then_resync(
    replica: MakeReplica,
    redis_server: RedisServer,
    otel_metrics: Metrics,
    caplog: pytest.LogCaptureFixture,
) -> None:
    accounts = (spec("x", failure_threshold=1, cooldown_secs=0.2), spec("y", cooldown_secs=30.0))
    a, store_a = await replica(*accounts)
    b, store_b = await replica(*accounts)
    degraded = otel_metrics.value(tm.STATE_DEGRADED)
    caplog.set_level(logging.WARNING, logger="switchyard_mw.state.redis_store")
    redis_server.kill()
    await until(lambda: not store_b.healthy)  # b hears it on its subscription
    # Requests keep flowing on local state, none waits for the store.
    worst = 0.0
    for _ in range(50):
        start = time.perf_counter()
        lease = await acquire_shared(a, "m")
        assert lease is not None
        a.record(lease, Outcome.SUCCESS)
        worst = max(worst, time.perf_counter() - start)
    await fault(a, "y")  # y: threshold 3, no cooling yet
    await fault(a, "x")
    assert cooled(a, "x")
    assert not cooled(b, "x")
    await asyncio.sleep(0.25)
    probe = await acquire_shared(
        a, "m", allowed={"x"}
    )  # due: the probe is granted locally, at once
    assert probe is not None
    assert probe.probe
    a.record(probe, Outcome.FAULT)  # re-cooled locally for 0.4 s
    for _ in range(2):
        await fault(a, "y")
    assert cooled(a, "y")
    assert not store_a.healthy
    assert worst < 0.15
    assert otel_metrics.value(tm.STATE_DEGRADED) - degraded == 2  # once per store, not per call
    unreachable = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(unreachable) == 2, [r.getMessage() for r in unreachable]
    # Redis comes back empty; both replicas reconnect, a pushes what it learnt alone.
    redis_server.start()
    await until(lambda: store_a.healthy and store_b.healthy)
    await until(lambda: cooled(b, "y"))
    assert 25 < cooled_for(b, "y") <= 30
    shared = await store_b.snapshot("y")
    assert shared.cooled_for_secs is not None
    assert shared.cooled_for_secs > 25


async def test_a_hung_redis_delays_no_request_beyond_the_timeout(
    replica: MakeReplica, redis_server: RedisServer
) -> None:
    accounts = (spec("x", failure_threshold=1, cooldown_secs=0.1), spec("y", priority=1))
    a, store = await replica(*accounts, timeout_secs=0.05)
    await fault(a)
    await asyncio.sleep(0.15)
    redis_server.pause()
    try:
        start = time.perf_counter()
        probe = await acquire_shared(a, "m")
        elapsed = time.perf_counter() - start
        assert probe is not None
        assert probe.probe
        assert probe.account == "x"
        assert elapsed < 0.1, elapsed
        assert not store.healthy
        start = time.perf_counter()
        for i in range(100):
            lease = await acquire_shared(a, "m", allowed={"y"})
            assert lease is not None
            a.record(lease, Outcome.FAULT if i % 2 else Outcome.SUCCESS)
        assert time.perf_counter() - start < 0.1
    finally:
        redis_server.resume()
    await until(lambda: store.healthy)
    # Back for good: what the hung connection left behind must not tear down the new one.
    a.record(probe, Outcome.FAULT)
    b, _ = await replica(*accounts)
    await asyncio.sleep(0.3)
    assert store.healthy
    await fault(b, "y")
    await until(lambda: a.status_of("y").consecutive_faults == 1, within=1.0)


async def test_foreign_messages_on_the_channel_are_ignored(
    replica: MakeReplica, redis_server: RedisServer
) -> None:
    a, _ = await replica(spec("x", failure_threshold=1))
    b, store_b = await replica(spec("x", failure_threshold=1))
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        for junk in (b"hello", b"cool|x|y|z|w|o|x", b"\xff\xfe"):
            await client.publish("t:events", junk)
    finally:
        await client.aclose()
    await fault(a)
    await until(lambda: cooled(b))
    assert store_b.healthy


async def test_a_connection_lost_while_catching_up_is_retried(
    replica: MakeReplica, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis dropping the subscription just as a reconnect finishes its resync: the reconnect
    must not report success with no subscription left (white-box: the race is too narrow to
    hit from outside reliably)."""
    a, store = await replica(spec("x"))
    b, _ = await replica(spec("x"))
    resync = store._resync
    calls = 0

    async def resync_then_drop() -> None:
        nonlocal calls
        calls += 1
        await resync()
        if calls == 1:  # what the listener reports when the connection drops right here
            store._lost(ConnectionError("dropped"), store._generation)

    monkeypatch.setattr(store, "_resync", resync_then_drop)
    store._lost(ConnectionError("test"), store._generation)
    await until(lambda: calls >= 2 and store.healthy)
    await asyncio.sleep(0.1)
    await fault(b)
    await until(lambda: a.status_of("x").consecutive_faults == 1, within=1.0)


async def test_closing_a_replica_frees_the_probe_slot_it_holds(replica: MakeReplica) -> None:
    accounts = (spec("x", failure_threshold=1, cooldown_secs=0.1),)
    a, store_a = await replica(*accounts)
    b, _ = await replica(*accounts)
    await fault(a)
    await asyncio.sleep(0.15)
    probe = await acquire_shared(a, "m")
    assert probe is not None
    assert probe.probe
    await until(lambda: b.status_of("x").probe_in_flight)
    await store_a.aclose()  # e.g. a rolling restart, its lease still 60 s from running out
    await until(lambda: not b.status_of("x").probe_in_flight, within=1.0)
    again = await acquire_shared(b, "m")
    assert again is not None
    assert again.probe


@pytest.mark.parametrize("accounts", [1, 3])  # one call alone; a batch (a pipeline)
async def test_a_server_that_lost_the_script_gets_it_again_without_an_outage(
    replica: MakeReplica, redis_server: RedisServer, otel_metrics: Metrics, accounts: int
) -> None:
    """As a replica promoted by a failover, or a cluster node a slot moved to: NOSCRIPT."""
    specs = [spec(f"a{i}", failure_threshold=1) for i in range(accounts)]
    a, store = await replica(*specs)
    b, _ = await replica(*specs)
    degraded = otel_metrics.value(tm.STATE_DEGRADED)
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        await client.script_flush()
        for i in range(accounts):  # in one go: the writer takes them as one batch
            await fault(a, f"a{i}")
        for i in range(accounts):
            await until(lambda i=i: cooled(b, f"a{i}"))  # type: ignore[misc]
            assert await client.hget(f"t:account:{{a{i}}}", "faults") == "1"  # counted once
    finally:
        await client.aclose()
    assert store.healthy
    assert otel_metrics.value(tm.STATE_DEGRADED) == degraded


async def test_every_replica_reads_half_open_once_the_cooling_ran_out(
    replica: MakeReplica,
) -> None:
    """No request after the cooling: every replica reads it half-open with the probe due; the
    probe one replica sends is in flight for the others; a replica that connects later learns
    the same from Redis."""
    accounts = (spec("x", failure_threshold=1, cooldown_secs=0.3),)
    a, _ = await replica(*accounts)
    b, _ = await replica(*accounts)
    await fault(a)
    await until(lambda: cooled(b))
    assert not b.status_of("x").probe_due
    await asyncio.sleep(0.35)  # over on both
    for pool in (a, b):
        status = pool.status_of("x")
        assert (status.state, status.cooled_until, status.probe_due) == (
            BreakerState.HALF_OPEN,
            None,
            True,
        )
    c, _ = await replica(*accounts)  # connected after the end: its resync says so
    await until(lambda: c.status_of("x").probe_due)
    assert c.status_of("x").state is BreakerState.HALF_OPEN
    probe = await acquire_shared(b, "m")
    assert probe is not None
    assert probe.probe
    for pool in (a, c):
        await until(lambda p=pool: p.status_of("x").probe_in_flight)  # type: ignore[misc]
        assert pool.status_of("x").state is BreakerState.HALF_OPEN
        assert not pool.status_of("x").probe_due
    b.record(probe, Outcome.FAULT)
    for pool in (a, c):
        await until(lambda p=pool: cooled(p))  # type: ignore[misc]
        assert not pool.status_of("x").probe_due
