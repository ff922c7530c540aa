"""Tenants' limits shared through a real Redis: two stores in one process stand for two
replicas (each its own connections); the soak (`bench/limits_soak.py`, its smoke run in
tests/bench) does the same across processes while Redis restarts."""

from __future__ import annotations

import asyncio
import calendar
import random
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from conftest import Metrics
from redis_server import RedisServer, running_redis, until
from switchyard_mw.config import State
from switchyard_mw.core.limits import Granted, LimitKey, Measure, Refused, window
from switchyard_mw.state import build_limits
from switchyard_mw.state._limits_lua import WINDOW_TEXT
from switchyard_mw.state.redis_limits import RedisLimits, limit_key
from switchyard_mw.telemetry import names as tm

pytestmark = pytest.mark.integration  # starts real servers

DAY = LimitKey(scope="team-a", measure=Measure.TOKENS, per="day", amount=1000)
OPUS = LimitKey(scope="team-a", measure=Measure.TOKENS, per="minute", amount=500, model="opus")
REQUESTS = LimitKey(scope="team-a", measure=Measure.REQUESTS, per="minute", amount=3)
FLEET = LimitKey(scope="", measure=Measure.TOKENS, per="hour", amount=800, model="opus")

MakeStore = Callable[..., RedisLimits]


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    yield from running_redis(tmp_path)


@pytest.fixture
async def store(redis_server: RedisServer) -> AsyncIterator[MakeStore]:
    made: list[RedisLimits] = []

    def make(**kw: object) -> RedisLimits:
        options: dict[str, object] = {"key_prefix": "t", "timeout_secs": 0.1}
        limits = RedisLimits(redis_server.url, **{**options, **kw})  # type: ignore[arg-type]
        made.append(limits)
        return limits

    yield make
    for limits in made:
        await limits.aclose()


@pytest.fixture
async def raw(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    yield client
    await client.aclose()


async def evalsha_calls(raw: aioredis.Redis) -> int:
    stats = await raw.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0)) + int(
        stats.get("cmdstat_eval", {}).get("calls", 0)
    )


async def test_the_scripts_windows_are_the_ledgers_on_calendar_boundaries(
    raw: aioredis.Redis,
) -> None:
    # Month ends (28, 29, 30, 31 days, a year's turn, leap years incl. 2000 and 2100) and
    # random instants: the script's (start, end) is core.limits.window's to the millisecond.
    instants = []
    for year, month in [(2024, 2), (2025, 2), (2000, 2), (2100, 2), (2026, 12), (2027, 4)]:
        first = calendar.timegm((year, month, 1, 0, 0, 0))
        instants += [first - 0.001, first, first + 0.001]
    rng = random.Random(7)
    instants += [rng.uniform(0, 4_102_444_800) for _ in range(200)]
    for now in instants:
        now_ms = int(now * 1000)
        for per in ("second", "minute", "hour", "day", "month"):
            start, end = window(per, now_ms / 1000)
            got = await raw.eval(WINDOW_TEXT, 0, per, str(now_ms))
            assert (int(got[0]), int(got[1])) == (round(start * 1000), round(end * 1000)), (
                per,
                now_ms,
            )


async def test_reserve_is_all_or_nothing_and_settle_replaces_the_reservation(
    store: MakeStore, raw: aioredis.Redis
) -> None:
    limits = store()
    granted = await limits.reserve({DAY: 400, OPUS: 400, REQUESTS: 1})
    assert isinstance(granted, Granted)
    assert granted.statuses[DAY].remaining == 600
    assert granted.statuses[OPUS].remaining == 100
    assert granted.statuses[REQUESTS].remaining == 2
    assert 0 < granted.statuses[OPUS].reset_secs <= 60
    # OPUS does not fit: nothing of it reserved on DAY either.
    refused = await limits.reserve({DAY: 200, OPUS: 200})
    assert isinstance(refused, Refused)
    assert refused.limit == OPUS
    assert not refused.never
    assert refused.status.remaining == 100
    assert refused.retry_after_secs == refused.status.reset_secs
    assert 0 < refused.retry_after_secs <= 60
    assert float(await raw.hget(limit_key("t", DAY), "n") or 0) == 400
    never = await limits.reserve({DAY: 1001})
    assert isinstance(never, Refused)
    assert never.never

    await limits.settle(granted.reservation, {Measure.TOKENS: 150.5, Measure.REQUESTS: 1})
    assert float(await raw.hget(limit_key("t", DAY), "n") or 0) == 150.5
    assert float(await raw.hget(limit_key("t", OPUS), "n") or 0) == 150.5
    assert float(await raw.hget(limit_key("t", REQUESTS), "n") or 0) == 1
    assert limits.used(DAY) == 150.5
    # A second settle of the same reservation changes nothing.
    await limits.settle(granted.reservation, {Measure.TOKENS: 1})
    assert float(await raw.hget(limit_key("t", DAY), "n") or 0) == 150.5

    second = await limits.reserve({DAY: 300})
    assert isinstance(second, Granted)
    await limits.release(second.reservation)
    assert float(await raw.hget(limit_key("t", DAY), "n") or 0) == 150.5
    assert limits.dropped_settles == 0


async def test_keys_are_named_tagged_and_expire_with_their_window(
    store: MakeStore, raw: aioredis.Redis
) -> None:
    limits = store()
    assert isinstance(await limits.reserve({DAY: 1, OPUS: 1, FLEET: 1}), Granted)
    assert limit_key("t", DAY) == "t:limit:{tenant:team-a}:tokens:day"
    assert limit_key("t", OPUS) == "t:limit:{tenant:team-a}:tokens:minute:model:opus"
    assert limit_key("t", FLEET) == "t:limit:{deployment}:tokens:hour:model:opus"
    assert sorted(await raw.keys("t:*")) == sorted(
        limit_key("t", key) for key in (DAY, OPUS, FLEET)
    )
    now_ms = int(await raw.eval("local t = redis.call('TIME') return t[1] * 1000", 0))
    for key in (DAY, OPUS, FLEET):
        start, end = window(key.per, now_ms / 1000)
        fields = await raw.hgetall(limit_key("t", key))
        assert int(fields["w"]) == round(start * 1000)
        assert await raw.type(limit_key("t", key)) == "hash"
        # It expires exactly when its window ends (Redis time).
        assert int(await raw.pexpiretime(limit_key("t", key))) == round(end * 1000)


async def test_one_script_call_per_reserve_and_per_settle(
    store: MakeStore, raw: aioredis.Redis
) -> None:
    limits = store()
    # The first run of each script on a server costs one more: EVALSHA, NOSCRIPT, then EVAL
    # (which leaves it cached there).
    warm = await limits.reserve({DAY: 1})
    assert isinstance(warm, Granted)
    await limits.release(warm.reservation)
    before = await evalsha_calls(raw)
    granted = await limits.reserve({DAY: 10, OPUS: 10, REQUESTS: 1, FLEET: 10})
    assert isinstance(granted, Granted)
    assert await evalsha_calls(raw) - before == 1
    await limits.settle(granted.reservation, {Measure.TOKENS: 5})
    assert await evalsha_calls(raw) - before == 2


async def test_a_spent_window_frees_when_the_next_begins(store: MakeStore) -> None:
    limits = store()
    second = LimitKey(scope="s", measure=Measure.REQUESTS, per="second", amount=2)
    for _ in range(2):
        assert isinstance(await limits.reserve({second: 1}), Granted)
    refused = await limits.reserve({second: 1})
    assert isinstance(refused, Refused)
    assert 0 < refused.retry_after_secs <= 1
    await asyncio.sleep(refused.retry_after_secs + 0.01)
    assert isinstance(await limits.reserve({second: 1}), Granted)


async def test_a_settle_after_the_window_rolled_charges_the_new_window(
    store: MakeStore, raw: aioredis.Redis
) -> None:
    limits = store()
    second = LimitKey(scope="s", measure=Measure.TOKENS, per="second", amount=100)
    granted = await limits.reserve({second: 90})
    assert isinstance(granted, Granted)
    await asyncio.sleep(granted.statuses[second].reset_secs + 0.01)
    await limits.settle(granted.reservation, {Measure.TOKENS: 30})
    # The old window's 90 went with it; the new one holds what was used.
    assert float(await raw.hget(limit_key("t", second), "n") or 0) == 30


@pytest.mark.parametrize("error", [0, 20])
async def test_two_replicas_under_64_concurrent_requests_overspend_at_most_the_estimate_error(
    store: MakeStore, raw: aioredis.Redis, error: int
) -> None:
    """Each request reserves its worst case (an input estimate of 100 + max_tokens 100) and
    uses up to `error` input tokens more than estimated: what the two replicas charged beyond
    the limit stays within the sum of those errors, and with exact estimates is 0."""
    # Room for 64 connections opened at once on a loaded machine: the point here is what Redis
    # counts, and every call must reach it (checked below).
    replicas = [store(timeout_secs=2.0), store(timeout_secs=2.0)]
    limit = LimitKey(scope="team", measure=Measure.TOKENS, per="day", amount=5_000)
    rng = random.Random(error)
    charged: list[float] = []
    bound = 0.0

    async def request(limits: RedisLimits) -> None:
        nonlocal bound
        for _ in range(6):
            reserved = 200.0
            outcome = await limits.reserve({limit: reserved})
            if isinstance(outcome, Refused):
                continue
            await asyncio.sleep(rng.uniform(0, 0.01))
            used = 100 + rng.randint(-error, error) + rng.randint(0, 100)
            bound += max(0.0, used - reserved)
            charged.append(used)
            await limits.settle(outcome.reservation, {Measure.TOKENS: used})

    await asyncio.gather(*(request(replicas[i % 2]) for i in range(64)))
    assert all(limits.healthy and not limits.dropped_settles for limits in replicas)
    stored = float(await raw.hget(limit_key("t", limit), "n") or 0)
    assert stored == pytest.approx(sum(charged))  # every settle landed, once
    overspend = max(0.0, sum(charged) - limit.amount)
    assert overspend <= bound
    if error == 0:
        assert overspend == 0
    assert len(charged) >= 25  # the limit was spent, not merely approached


async def test_a_dead_store_falls_back_to_the_replicas_share_without_waiting(
    store: MakeStore, redis_server: RedisServer, otel_metrics: Metrics
) -> None:
    limits = store(replicas_hint=2, timeout_secs=0.1)
    shared = await limits.reserve({DAY: 100})
    assert isinstance(shared, Granted)
    assert not limits.on_share(shared.reservation)  # Redis holds it
    degraded = otel_metrics.value(tm.STATE_DEGRADED)
    redis_server.kill()

    began = time.perf_counter()
    first = await limits.reserve({DAY: 400})
    assert time.perf_counter() - began < 0.1 + 0.15
    assert isinstance(first, Granted)
    assert not limits.healthy
    assert limits.on_share(first.reservation)
    assert not limits.on_share(shared.reservation)  # still Redis's, whatever the health now
    # The share is 1000 / 2 = 500, seeded with its half of the 100 Redis last held: 50 + 400
    # held, 50 more fits and 51 does not.
    refused = await limits.reserve({DAY: 51})
    assert isinstance(refused, Refused)
    assert refused.limit == DAY
    assert refused.status.limit == 500
    assert refused.status.remaining == 50
    began = time.perf_counter()
    fits = await limits.reserve({DAY: 50})
    assert isinstance(fits, Granted)
    assert fits.statuses[DAY].remaining == 0
    # The reservation Redis held: its settle is dropped, at once.
    await limits.settle(shared.reservation, {Measure.TOKENS: 50})
    assert time.perf_counter() - began < 0.05
    assert limits.dropped_settles == 1
    # A local reservation settles locally.
    await limits.settle(first.reservation, {Measure.TOKENS: 10})
    assert limits.used(DAY) == 50 + 10 + 50
    assert otel_metrics.value(tm.STATE_DEGRADED) - degraded == 1  # once per outage


async def test_a_hung_store_costs_a_request_at_most_the_timeout(
    store: MakeStore, redis_server: RedisServer
) -> None:
    limits = store(timeout_secs=0.05)
    assert isinstance(await limits.reserve({DAY: 1}), Granted)
    redis_server.pause()
    try:
        began = time.perf_counter()
        outcome = await limits.reserve({DAY: 1})
        waited = time.perf_counter() - began
    finally:
        redis_server.resume()
    assert isinstance(outcome, Granted)
    assert waited < 0.05 + 0.1
    assert not limits.healthy


async def test_after_a_restart_the_replica_merges_up_and_new_requests_use_redis_again(
    store: MakeStore, redis_server: RedisServer, raw: aioredis.Redis
) -> None:
    limits = store(reconnect_max_secs=0.1)
    assert isinstance(await limits.reserve({DAY: 40}), Granted)
    redis_server.kill()
    local = await limits.reserve({DAY: 5})
    assert isinstance(local, Granted)
    assert limits.used(DAY) == 45  # seeded with the 40 last read (replicas_hint 1)
    redis_server.start()  # empty: no data, no scripts
    await until(lambda: limits.healthy, within=5.0)
    # What it last read (40, a floor) and what it reserved alone (5) went up.
    assert float(await raw.hget(limit_key("t", DAY), "n") or 0) == 45
    shared = await limits.reserve({DAY: 7})
    assert isinstance(shared, Granted)
    assert float(await raw.hget(limit_key("t", DAY), "n") or 0) == 52
    # The reservation made during the outage settles where it was made.
    await limits.settle(local.reservation, {Measure.TOKENS: 2})
    assert float(await raw.hget(limit_key("t", DAY), "n") or 0) == 52
    await limits.settle(shared.reservation, {Measure.TOKENS: 3})
    assert float(await raw.hget(limit_key("t", DAY), "n") or 0) == 48


async def test_two_replicas_merging_after_a_restart_add_their_outages_on_the_largest_floor(
    store: MakeStore, redis_server: RedisServer, raw: aioredis.Redis
) -> None:
    one, two = store(replicas_hint=2, reconnect_max_secs=0.1), store(replicas_hint=2)
    assert isinstance(await one.reserve({DAY: 100}), Granted)
    assert isinstance(await two.reserve({DAY: 100}), Granted)  # two read 200, one 100
    redis_server.kill()
    assert isinstance(await one.reserve({DAY: 30}), Granted)
    assert isinstance(await two.reserve({DAY: 20}), Granted)
    # Each share (500) started from its half of what it last read.
    assert (one.used(DAY), two.used(DAY)) == (50 + 30, 100 + 20)
    redis_server.start()
    await until(lambda: one.healthy and two.healthy, within=5.0)
    # max(floors) + both outages, whichever merged first.
    assert float(await raw.hget(limit_key("t", DAY), "n") or 0) == 200 + 30 + 20
    # A second outage in the same window: the floor is what `one` read last (250), and of its
    # share's use only what is new goes up.
    assert isinstance(await one.reserve({DAY: 0}), Granted)
    redis_server.kill()
    assert isinstance(await one.reserve({DAY: 1}), Granted)
    # Its share is raised to half of what it read last (80 of its own so far, now 125).
    assert one.used(DAY) == 250 / 2 + 1
    redis_server.start()
    await until(lambda: one.healthy, within=5.0)
    assert float(await raw.hget(limit_key("t", DAY), "n") or 0) == 250 + 1


async def test_after_an_outage_that_kept_the_data_only_the_local_use_goes_up(
    store: MakeStore, redis_server: RedisServer, raw: aioredis.Redis
) -> None:
    limits = store(timeout_secs=0.05, reconnect_max_secs=0.1)
    assert isinstance(await limits.reserve({DAY: 100}), Granted)
    redis_server.pause()  # hung, not restarted: its data stays
    try:
        local = await limits.reserve({DAY: 10})
    finally:
        redis_server.resume()
    assert isinstance(local, Granted)
    assert not limits.healthy
    await until(lambda: limits.healthy, within=5.0)
    held = float(await raw.hget(limit_key("t", DAY), "n") or 0)
    # The same hash: the floor read (100) is not added again; the local 10 is. The reserve
    # that timed out was already in the stopped server's socket: it ran when it resumed, and
    # holds its 10 too (a reservation nobody settles, counted until the window ends).
    assert held in (110, 120)


async def test_state_builds_the_redis_store_with_its_share(redis_server: RedisServer) -> None:
    state = State(backend="redis", url=redis_server.url, key_prefix="b", replicas_hint=4)
    limits = build_limits(state)
    try:
        assert isinstance(limits, RedisLimits)
        assert limits.name == "redis"
        assert isinstance(await limits.reserve({DAY: 1}), Granted)
    finally:
        await limits.aclose()
    assert build_limits(State()).name == "memory"


async def test_a_slow_first_call_is_no_outage_two_replicas_spend_one_limit(
    store: MakeStore, redis_server: RedisServer, otel_metrics: Metrics
) -> None:
    """Redis answers nothing for the first 3 s (3 x timeout_secs) while two replicas that
    never reached it take 64 concurrent requests against 3,000 tokens: their first calls
    (connecting, loading the scripts) wait out the start-up (5 s) once instead of starting an
    outage, and together they spend the limit once, not once each.

    The bound is 1 s, not the default 0.1 s: once Redis is back, 64 requests' calls go out
    at once, each on a new connection, and a loaded CI machine (two cores, two test workers)
    stalled the loop past 0.1 s once and past 0.5 s once (both replicas timed out within
    10 ms of each other, as Redis came back), an outage the test is not about."""
    limit = LimitKey(scope="team", measure=Measure.TOKENS, per="day", amount=3_000)
    replicas = [store(timeout_secs=1.0), store(timeout_secs=1.0)]  # replicas_hint 1
    degraded = otel_metrics.value(tm.STATE_DEGRADED)
    charged: list[float] = []

    async def request(limits: RedisLimits) -> None:
        for _ in range(4):
            outcome = await limits.reserve({limit: 200})
            if isinstance(outcome, Granted):
                charged.append(200)
                await limits.settle(outcome.reservation, {Measure.TOKENS: 200})

    redis_server.pause()
    try:
        work = asyncio.gather(*(request(replicas[i % 2]) for i in range(64)))
        await asyncio.sleep(3.0)
    finally:
        redis_server.resume()
    await work
    assert sum(charged) == limit.amount  # 15 requests of 200: overspend 0
    assert all(limits.healthy and not limits.dropped_settles for limits in replicas)
    assert otel_metrics.value(tm.STATE_DEGRADED) == degraded


async def test_start_connects_before_the_first_request_and_waits_a_bounded_time(
    store: MakeStore, redis_server: RedisServer, raw: aioredis.Redis, otel_metrics: Metrics
) -> None:
    # A hung Redis that answers after 300 ms: start waits for it (the scripts are loaded
    # then, so the first reserve is one EVALSHA), no outage.
    limits = store(timeout_secs=0.05)
    redis_server.pause()
    asyncio.get_running_loop().call_later(0.3, redis_server.resume)
    began = time.perf_counter()
    await limits.start()
    assert 0.25 < time.perf_counter() - began < 1.0
    assert limits.healthy
    scripts = await raw.info("commandstats")
    assert int(scripts.get("cmdstat_script|load", {}).get("calls", 0)) >= 2
    before = await evalsha_calls(raw)
    assert isinstance(await limits.reserve({DAY: 1}), Granted)
    assert await evalsha_calls(raw) - before == 1
    # A Redis that never answers: start gives up after the start-up time (max(1 s, 10 x
    # timeout_ms)) and the replica is in an outage, its share from then on.
    degraded = otel_metrics.value(tm.STATE_DEGRADED)
    later = store(timeout_secs=0.05)
    redis_server.pause()
    try:
        began = time.perf_counter()
        await later.start()
        waited = time.perf_counter() - began
        assert 0.95 < waited < 1.5
        assert not later.healthy
        assert otel_metrics.value(tm.STATE_DEGRADED) - degraded == 1
        began = time.perf_counter()
        assert isinstance(await later.reserve({DAY: 1}), Granted)  # its share, at once
        assert time.perf_counter() - began < 0.05
    finally:
        redis_server.resume()


async def test_closing_during_the_start_up_wait_ends_it(
    store: MakeStore, redis_server: RedisServer
) -> None:
    limits = store(timeout_secs=0.05)
    redis_server.pause()
    try:
        waiting = asyncio.create_task(limits.start())
        await asyncio.sleep(0.2)
        began = time.perf_counter()
        await limits.aclose()
        assert time.perf_counter() - began < 0.5  # not the rest of the 1 s start-up
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await asyncio.sleep(0.1)
        assert limits._commands is None  # no client made after the close
    finally:
        redis_server.resume()
