"""Throttle holds and canary-guard trips kept in Redis with their expiry: a replica that starts
or reconnects later applies every one in force, as one listening all along does.

Each replica is a pool, a canary board and a store in this process (as in
`test_state_redis.py`); across real processes see `test_state_live.py`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from conftest import Metrics
from redis_server import RedisServer, running_redis, until
from switchyard_mw.core.guard import GuardRule
from switchyard_mw.core.pool import MAX_HOLDS, AccountPool, AccountSpec
from switchyard_mw.core.variant_buckets import Split
from switchyard_mw.engine.variants import Canaries
from switchyard_mw.state import _standing as standing
from switchyard_mw.state.redis_store import RedisStore
from switchyard_mw.telemetry import names as tm

pytestmark = pytest.mark.integration  # starts real servers

RULE = GuardRule(max_fault_rate=0.1, min_requests=10, window_secs=60.0)


@dataclass
class Replica:
    pool: AccountPool
    canaries: Canaries
    store: RedisStore

    def hold(self, account: str, model: str, secs: float) -> None:
        """A 429 that says "retry in `secs`", as the engine records it."""
        assert self.pool.hold(account, model, secs, wall_now=time.time()) > 0

    def held_for(self, account: str, model: str) -> float:
        """Seconds left of the hold of `account` for `model` here (0: none)."""
        until_ = self.pool.holds_of(account).get(model)
        return 0.0 if until_ is None else until_ - self.pool.clock()


MakeReplica = Callable[..., Awaitable[Replica]]


def caught_up(store: RedisStore) -> bool:
    """Connected, and done reading what is in force (white-box: `healthy` comes first, so that
    no write is dropped while the resync runs)."""
    connector = store._tasks.get("connector")
    return store.healthy and connector is not None and connector.done()


def board(share: float = 20.0, *, salt: str = "") -> Canaries:
    """Canary `base` moving `share` percent to `var-a` and 20 to `var-b`, guarded."""
    split = Split.build("base", [("var-a", share), ("var-b", 20.0)], salt)
    return Canaries({"base": split}, guards={"base": RULE})


def specs(*names: str, max_throttle_secs: float = 60.0) -> list[AccountSpec]:
    return [
        AccountSpec(name=n, models=frozenset({"m", "*"}), max_throttle_secs=max_throttle_secs)
        for n in names
    ]


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    yield from running_redis(tmp_path)


@pytest.fixture
async def redis_client(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    yield client
    await client.aclose()


@pytest.fixture
async def replica(redis_server: RedisServer) -> AsyncIterator[MakeReplica]:
    stores: list[RedisStore] = []

    async def make(
        *accounts: AccountSpec,
        canaries: Canaries | None = None,
        url: str | None = None,
        timeout_secs: float = 0.1,
    ) -> Replica:
        store = RedisStore(
            url or redis_server.url,
            key_prefix="t",
            timeout_secs=timeout_secs,
            reconnect_max_secs=0.2,
        )
        stores.append(store)
        return await started(store, *accounts, canaries=canaries)

    yield make
    for store in stores:
        await store.aclose()


async def started(
    store: RedisStore, *accounts: AccountSpec, canaries: Canaries | None = None
) -> Replica:
    """A replica on `store` (accounts x and y, canary `base` by default), caught up."""
    pool = AccountPool(accounts or specs("x", "y"))
    board_ = canaries if canaries is not None else board()
    store.bind(pool)
    store.share_trips(board_)
    await store.start()
    await until(lambda: caught_up(store), within=10.0)
    return Replica(pool, board_, store)


async def test_a_replica_that_starts_after_a_hold_applies_it(
    replica: MakeReplica, redis_client: aioredis.Redis
) -> None:
    a = await replica()
    listening = await replica()
    a.hold("x", "m", 30.0)
    a.hold("y", "other-model", 10.0)
    await until(lambda: listening.held_for("y", "other-model") > 0)  # pub/sub, as before
    assert await redis_client.zcard("t:holds:{x}") == 1

    late = await replica()  # started after the holds: it reads them on connect
    assert 29 < late.held_for("x", "m") <= 30
    assert 9 < late.held_for("y", "other-model") <= 10
    assert late.held_for("x", "other-model") == 0
    # The key lasts as long as its longest hold, not a millisecond more.
    assert 29_000 < await redis_client.pttl("t:holds:{x}") <= 30_000


async def test_an_ended_hold_is_neither_applied_nor_kept(
    replica: MakeReplica, redis_client: aioredis.Redis
) -> None:
    a = await replica()
    a.hold("x", "short", 0.3)
    a.hold("x", "long", 30.0)
    await until_count(redis_client, "t:holds:{x}", 2)
    await asyncio.sleep(0.5)  # the short hold ended 0.2 s ago

    late = await replica()
    assert late.held_for("x", "short") == 0
    assert 29 < late.held_for("x", "long") <= 30
    # Reading pruned it: only the hold in force is left.
    assert await redis_client.zrange("t:holds:{x}", 0, -1) == ["long"]


async def test_a_hold_s_key_expires_with_its_last_hold(
    replica: MakeReplica, redis_client: aioredis.Redis
) -> None:
    a = await replica()
    a.hold("x", "m", 0.3)
    await until_count(redis_client, "t:holds:{x}", 1)
    await asyncio.sleep(0.45)
    assert await redis_client.exists("t:holds:{x}") == 0  # gone without any replica's help


async def test_a_shared_hold_keeps_its_cap_and_only_grows(
    replica: MakeReplica, redis_client: aioredis.Redis
) -> None:
    a = await replica(*specs("x", "y", max_throttle_secs=5.0))
    b = await replica(*specs("x", "y", max_throttle_secs=5.0))
    a.hold("x", "m", 60.0)  # capped by max_throttle_secs here: 5 s
    await until(lambda: b.held_for("x", "m") > 0)
    assert 4.5 < b.held_for("x", "m") <= 5
    b.hold("x", "m", 1.0)  # shorter: leaves the longer hold in force, here and in Redis
    await asyncio.sleep(0.1)
    late = await replica(*specs("x", "y", max_throttle_secs=5.0))
    assert 4 < late.held_for("x", "m") <= 5


async def test_holds_kept_per_account_stop_at_the_cap(
    replica: MakeReplica, redis_client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wildcard account is held per model string a client sent: two replicas holding more
    models than the cap leave at most the cap in Redis, and a late replica reads them all.
    The cap is each pool's (`MAX_HOLDS`); here a smaller one, for speed."""
    assert standing.MAX_HOLDS == MAX_HOLDS
    cap = 300
    monkeypatch.setattr(standing, "MAX_HOLDS", cap)
    # One process plays two replicas, each parsing the other's hundreds of messages: room
    # enough that a loaded machine does not turn that into an outage.
    a = await replica(timeout_secs=1.0)
    b = await replica(timeout_secs=1.0)
    for i in range(cap // 2 + 50):
        a.hold("x", f"a-{i}", 30.0)
        b.hold("x", f"b-{i}", 30.0)
    await until_count(redis_client, "t:holds:{x}", cap)
    await asyncio.sleep(0.2)
    assert await redis_client.zcard("t:holds:{x}") == cap
    assert a.store.healthy
    assert b.store.healthy
    late = await replica()
    assert late.pool.hold_count() == cap
    a.hold("x", "a-0", 40.0)  # a model already kept may still be held longer at the cap
    await until(lambda: late.held_for("x", "a-0") > 35)


async def test_a_replica_that_starts_after_a_trip_applies_it(
    replica: MakeReplica, redis_client: aioredis.Redis
) -> None:
    a = await replica()
    listening = await replica()
    a.canaries.trip("base", "var-a")
    await until(lambda: listening.canaries.tripped("base", "var-a"))  # pub/sub, as before
    await until_count(redis_client, "t:trips", 1, kind="hash")

    late = await replica()
    assert late.canaries.tripped("base", "var-a")
    assert not late.canaries.tripped("base", "var-b")
    assert late.canaries.choose("base", "user-1", None) is not None
    # Configured otherwise (another share, another salt): the trip is not this canary's.
    for other in (board(share=30.0), board(salt="s2")):
        elsewhere = await replica(canaries=other)
        assert not elsewhere.canaries.tripped("base", "var-a")


async def test_a_reload_ends_the_stored_trips(
    replica: MakeReplica, redis_client: aioredis.Redis
) -> None:
    a = await replica()
    a.canaries.trip("base", "var-a")
    await until_count(redis_client, "t:trips", 1, kind="hash")
    reloaded = board()
    a.store.share_trips(reloaded)  # what a reload does: fresh guards
    await until_count(redis_client, "t:trips", 0, kind="hash")
    late = await replica()
    assert not late.canaries.tripped("base", "var-a")
    # A trip of the replaced config's guard (a request still under way on it) stays out.
    a.canaries.trip("base", "var-b")
    reloaded.trip("base", "var-a")
    await until(lambda: late.canaries.tripped("base", "var-a"))
    await asyncio.sleep(0.1)
    assert not late.canaries.tripped("base", "var-b")
    assert await redis_client.hlen("t:trips") == 1


async def test_a_reload_during_an_outage_ends_the_stored_trips_once_back(
    replica: MakeReplica, redis_server: RedisServer, redis_client: aioredis.Redis
) -> None:
    async with Link(redis_server.port) as link:
        a = await replica(url=link.url)
        a.canaries.trip("base", "var-a")
        await until_count(redis_client, "t:trips", 1, kind="hash")
        await link.cut()
        await until(lambda: not a.store.healthy)
        a.store.share_trips(board())  # reloaded while Redis is out of reach
        await link.restore()
        await until_count(redis_client, "t:trips", 0, kind="hash", within=10.0)
    late = await replica()
    assert not late.canaries.tripped("base", "var-a")


async def test_a_redis_restarted_empty_is_filled_again_from_the_replicas(
    replica: MakeReplica, redis_server: RedisServer, redis_client: aioredis.Redis
) -> None:
    """Redis forgot everything: what replicas still hold in force goes back up on their resync
    (holds with what is left of them, trips), and reaches every replica."""
    a = await replica()
    other = await replica()
    a.hold("x", "m", 30.0)
    a.canaries.trip("base", "var-a")
    await until(lambda: other.held_for("x", "m") > 0 and other.canaries.tripped("base", "var-a"))
    redis_server.kill()
    await until(lambda: not a.store.healthy)
    a.hold("y", "m", 30.0)  # during the outage: applied here only
    a.canaries.trip("base", "var-b")
    redis_server.start()
    await until(lambda: a.store.healthy and other.store.healthy)
    await until(lambda: other.held_for("y", "m") > 0 and other.canaries.tripped("base", "var-b"))

    late = await replica()
    assert 28 < late.held_for("x", "m") <= 30
    assert 28 < late.held_for("y", "m") <= 30
    assert late.canaries.tripped("base", "var-a")
    assert late.canaries.tripped("base", "var-b")


async def test_a_replica_that_reconnects_applies_what_it_missed(
    replica: MakeReplica, redis_server: RedisServer
) -> None:
    """The messages sent while a replica was cut off from Redis never reach it (Redis itself
    stayed up and lost nothing): its resync reads them."""
    a = await replica()
    async with Link(redis_server.port) as link:
        cut = await replica(url=link.url)
        await link.cut()
        await until(lambda: not cut.store.healthy)
        a.hold("x", "m", 30.0)
        a.canaries.trip("base", "var-a")
        await asyncio.sleep(0.3)  # published: every listener has it, `cut` has not
        assert cut.held_for("x", "m") == 0
        assert not cut.canaries.tripped("base", "var-a")
        await link.restore()
        await until(
            lambda: cut.held_for("x", "m") > 0 and cut.canaries.tripped("base", "var-a"),
            within=10.0,
        )  # on its resync
        assert 28 < cut.held_for("x", "m") <= 30
        assert cut.canaries.tripped("base", "var-a")


async def test_a_server_without_the_scripts_gets_them_again_without_an_outage(
    replica: MakeReplica, redis_client: aioredis.Redis, otel_metrics: Metrics
) -> None:
    """As a promoted replica or a slot's new owner: NOSCRIPT, then loaded, then run."""
    a = await replica()
    degraded = otel_metrics.value(tm.STATE_DEGRADED)
    await redis_client.script_flush()
    a.hold("x", "m", 30.0)
    a.canaries.trip("base", "var-a")
    await until_count(redis_client, "t:holds:{x}", 1)
    await until_count(redis_client, "t:trips", 1, kind="hash")
    await redis_client.script_flush()
    late = await replica()  # its resync runs them on a server that lost them again
    assert late.held_for("x", "m") > 28
    assert late.canaries.tripped("base", "var-a")
    assert otel_metrics.value(tm.STATE_DEGRADED) == degraded


async def test_junk_on_the_channel_or_in_the_keys_is_ignored(
    replica: MakeReplica, redis_client: aioredis.Redis
) -> None:
    """Anyone may publish on the channel or write the keys: what is not ours in every field
    neither breaks a replica nor trips or holds anything."""
    listening = await replica()
    signature = listening.canaries.signature("base")
    for field, value in (
        ("not json", signature),
        ('["base"]', signature),
        ('["base", 1]', signature),
        ('["base", "var-a"]', "another config"),
        ('["base", "no-such-variant"]', signature),
    ):
        await redis_client.hset("t:trips", field, value)
    junk = [
        '{"t": "hold", "a": "x", "m": "m", "l": "soon", "o": "z"}',
        '{"t": "hold", "a": "x", "m": "m", "l": -5, "o": "z"}',
        '{"t": "trip", "b": "base", "v": "var-a", "s": "another config", "o": "z"}',
        '{"t": "trip", "b": "base", "v": "var-a", "s": 7, "o": "z"}',
        '{"t": [1, 2',
        '{"t": "hold"}',
    ]
    for note in junk:
        await redis_client.publish("t:events", note)
    late = await replica()
    await asyncio.sleep(0.1)
    for r in (listening, late):
        assert r.store.healthy
        assert r.pool.hold_count() == 0
        assert not r.canaries.tripped("base", "var-a")
    a = await replica()
    a.hold("x", "m", 30.0)  # and what is ours still comes through
    await until(lambda: listening.held_for("x", "m") > 0 and late.held_for("x", "m") > 0)


class Link:
    """A TCP relay to Redis on a port of its own, which a test cuts (every connection closed,
    new ones refused) and restores: a network partition of one replica."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def __aenter__(self) -> Link:
        await self.restore()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.cut()

    async def restore(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            writer.close()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._writers -= {writer, up_writer}


async def until_count(
    client: aioredis.Redis, key: str, count: int, *, kind: str = "zset", within: float = 5.0
) -> None:
    end = time.monotonic() + within
    while True:
        found = await (client.zcard(key) if kind == "zset" else client.hlen(key))
        if found == count:
            return
        assert time.monotonic() < end, f"{key}: {found} entries, not {count}"
        await asyncio.sleep(0.005)
