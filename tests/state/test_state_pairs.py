"""Faults per (account, model) shared through Redis, in each `[state] mode`: a model fault of an
account serving two models cools that pair on every replica and leaves the other model alone;
its probe slot is claimed once across replicas; a refused key cools the account for both
models everywhere; a replica that starts later reads the pair's cooling. On a cluster, the
pair's keys live in the account's slot.

Each replica is a pool and a store in this process (as in `test_state_redis.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass

import pytest
from redis.crc import key_slot

from redis_server import running_cluster, running_redis, running_sentinels, until
from switchyard_mw.core.pool import AccountPool, AccountSpec, BreakerState, Cause, Outcome
from switchyard_mw.engine.claims import acquire_shared
from switchyard_mw.state._lua import keys
from switchyard_mw.state.redis_store import RedisStore

pytestmark = pytest.mark.integration  # starts real servers

MODES = ("standalone", "cluster", "sentinel")


@dataclass(frozen=True)
class Target:
    mode: str
    url: str | None
    sentinels: tuple[tuple[str, int], ...] = ()


@pytest.fixture(scope="module", params=MODES)
def target(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Target]:
    workdir = tmp_path_factory.mktemp(request.param)
    if request.param == "standalone":
        for server in running_redis(workdir):
            yield Target("standalone", server.url)
    elif request.param == "cluster":
        for cluster in running_cluster(workdir):
            yield Target("cluster", cluster.url)
    else:
        for group in running_sentinels(workdir):
            addresses = tuple(("127.0.0.1", port) for port in group.sentinel_ports)
            yield Target("sentinel", None, addresses)


MakeReplica = Callable[[], Awaitable[AccountPool]]

ACCOUNT = AccountSpec(
    name="x", models=frozenset({"m1", "m2"}), failure_threshold=1, cooldown_secs=0.5
)
OTHER = AccountSpec(name="y", models=frozenset({"m1", "m2"}), priority=1)


@pytest.fixture
async def replica(target: Target, request: pytest.FixtureRequest) -> AsyncIterator[MakeReplica]:
    stores: list[RedisStore] = []
    prefix = f"pairs-{request.node.name}"  # one module-wide server: keys of their own per test

    async def make() -> AccountPool:
        pool = AccountPool((ACCOUNT, OTHER))
        store = RedisStore(
            target.url,
            mode=target.mode,  # type: ignore[arg-type]
            sentinels=target.sentinels,
            key_prefix=prefix,
            timeout_secs=0.5,
            reconnect_max_secs=0.2,
        )
        store.bind(pool)
        stores.append(store)
        await store.start()
        await until(lambda: store.healthy and store._tasks["connector"].done(), within=10.0)
        return pool

    yield make
    for store in stores:
        await store.aclose()


def state(pool: AccountPool, model: str | None = None) -> BreakerState:
    return pool.status_of("x", model=model).state


async def fail(pool: AccountPool, model: str, cause: Cause = Cause.OUTAGE) -> None:
    lease = await acquire_shared(pool, model, allowed={"x"})
    assert lease is not None
    pool.record(lease, Outcome.FAULT, cause)


async def test_a_model_fault_cools_the_pair_on_every_replica_and_not_the_other_model(
    replica: MakeReplica,
) -> None:
    a, b = await replica(), await replica()
    await fail(a, "m1")
    await until(lambda: state(b, "m1") is BreakerState.COOLED)
    assert state(b) is BreakerState.CLOSED  # the account itself is fine
    assert b.acquire("m1").account == "y"  # type: ignore[union-attr]
    assert b.acquire("m2", allowed={"x"}) is not None

    late = await replica()  # started after the cooling: it reads the pair's on connect
    # Half-open once the 0.5 s period ran out while it connected (a loaded machine): either way
    # not closed, so the pair's cooling reached it.
    assert state(late, "m1") in (BreakerState.COOLED, BreakerState.HALF_OPEN)
    assert late.acquire("m2", allowed={"x"}) is not None


async def test_the_pairs_probe_is_claimed_once_and_its_success_closes_it_everywhere(
    replica: MakeReplica,
) -> None:
    a, b = await replica(), await replica()
    await fail(a, "m1")
    await until(lambda: state(b, "m1") is BreakerState.COOLED)
    await asyncio.sleep(0.55)
    probe = await acquire_shared(b, "m1", allowed={"x"})
    assert probe is not None
    assert probe.pair_probe
    assert await acquire_shared(a, "m1", allowed={"x"}) is None  # b holds the pair's slot
    # The account's own slot is untouched: m2 is served on x meanwhile.
    assert (await acquire_shared(a, "m2", allowed={"x"})) is not None
    b.record(probe, Outcome.SUCCESS)
    await until(lambda: state(a, "m1") is BreakerState.CLOSED)
    assert (await acquire_shared(a, "m1", allowed={"x"})) is not None


async def test_a_refused_key_cools_the_account_for_every_model_everywhere(
    replica: MakeReplica,
) -> None:
    a, b = await replica(), await replica()
    await fail(a, "m1", Cause.CREDENTIALS)
    await until(lambda: state(b) is BreakerState.COOLED)
    assert b.status_of("x").cause is Cause.CREDENTIALS
    assert b.acquire("m2", allowed={"x"}) is None
    assert b.acquire("m1", allowed={"x"}) is None


def test_a_pairs_keys_share_the_accounts_slot() -> None:
    for account, model in (("x", "m1"), ("acct-b", "gpt-x-mini"), ("a}b", "vendor/m:1")):
        slots = {key_slot(k.encode()) for k in keys("p", account) + keys("p", account, model)}
        assert len(slots) == 1, (account, model)
