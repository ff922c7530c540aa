"""Shared cooling across processes: a replica in a subprocess, and the example gateway under
`uvicorn --workers 2` with `[state] backend = "redis"`, on a real `redis-server` and the mock;
a gateway started later applies the holds and trips in force.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from redis_server import RedisServer, running_redis
from servers import ROOT, example_gateway, serve_in_thread
from switchyard_mw.core.pool import AccountPool, AccountSpec, BreakerState, Outcome
from switchyard_mw.engine.claims import acquire_shared
from switchyard_mw.state.redis_store import RedisStore
from switchyard_mw.testing import Behaviour, MockProvider

pytestmark = pytest.mark.integration  # starts real servers

WATCHER = """
import asyncio, sys, time
from switchyard_mw.core.pool import AccountPool, AccountSpec, BreakerState
from switchyard_mw.state.redis_store import RedisStore

async def main() -> None:
    pool = AccountPool([AccountSpec(name="x", models=frozenset({"m"}), failure_threshold=1)])
    store = RedisStore(sys.argv[1], key_prefix="live")
    store.bind(pool)
    await store.start()
    while not store.healthy:
        await asyncio.sleep(0.001)
    print("ready", flush=True)
    while pool.status_of("x").state is not BreakerState.COOLED:
        await asyncio.sleep(0.0002)
    print(time.monotonic(), flush=True)  # CLOCK_MONOTONIC: one clock for every process
    await store.aclose()

asyncio.run(main())
"""


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    yield from running_redis(tmp_path)


async def test_a_cooling_reaches_another_process_in_milliseconds(
    redis_server: RedisServer,
) -> None:
    watcher = await asyncio.create_subprocess_exec(
        sys.executable, "-c", WATCHER, redis_server.url, cwd=ROOT, stdout=subprocess.PIPE
    )
    assert watcher.stdout is not None
    pool = AccountPool([AccountSpec(name="x", models=frozenset({"m"}), failure_threshold=1)])
    store = RedisStore(redis_server.url, key_prefix="live")
    store.bind(pool)
    try:
        await store.start()
        assert (await watcher.stdout.readline()).strip() == b"ready"
        lease = await acquire_shared(pool, "m")
        assert lease is not None
        cooled_at = time.monotonic()
        pool.record(lease, Outcome.FAULT)
        seen_at = float(await watcher.stdout.readline())
        assert await asyncio.wait_for(watcher.wait(), 10) == 0
    finally:
        if watcher.returncode is None:
            watcher.kill()
            await watcher.wait()
        await store.aclose()
    latency = seen_at - cooled_at
    print(f"cross-process propagation: {latency * 1000:.2f} ms")
    assert 0 < latency < 0.25
    assert pool.status_of("x").state is BreakerState.COOLED


@pytest.fixture(scope="module")
def mock() -> Iterator[tuple[MockProvider, str]]:
    provider = MockProvider()
    with serve_in_thread(provider) as url:
        yield provider, url


def gateway_config(mock_url: str, state: str) -> str:
    accounts = ""
    for name, priority in (("refused", 0), ("good", 1)):
        accounts += f"""
        [llm_clients.{name}]
        base_url = "{mock_url}"
        api_key_env = "KEY_{name.upper()}"
        auth = "x-api-key"
        models = ["claude-shared"]
        priority = {priority}
        failure_threshold = 1
        cooldown_secs = 300
        """
    return textwrap.dedent(state) + textwrap.dedent(accounts)


def ask(gateway: str) -> httpx.Response:
    """One request on a fresh connection, so that the kernel may hand it to either worker."""
    messages = [{"role": "user", "content": "hi"}]
    body = {"model": "claude-shared", "max_tokens": 16, "messages": messages}
    with httpx.Client(base_url=gateway, timeout=10) as client:
        return client.post("/v1/messages", json=body, headers={"x-api-key": "caller"})


def refused_tries(
    requests: int, mock: tuple[MockProvider, str], tmp_path: Path, state: str, *, shared: bool
) -> int:
    """Send `requests` through a two-worker gateway; how often the refused key reached the mock.

    `shared`: the workers share state, so whichever answers must show the account cooled
    (without sharing, a worker the kernel handed no request to has never seen the refusal).
    """
    provider, url = mock
    provider.reset()
    provider.set_behaviour("refused-key", Behaviour(status=401))
    env = {"KEY_REFUSED": "refused-key", "KEY_GOOD": "good-key"}
    with example_gateway(gateway_config(url, state), tmp_path, env, workers=2) as gateway:
        for _ in range(requests):
            response = ask(gateway)
            assert response.status_code == 200
            assert response.headers["x-switchyard-account"] == "good"
        for _ in range(10 if shared else 0):  # whichever worker answers shows it cooled
            accounts = httpx.get(f"{gateway}/switchyard/accounts").json()["accounts"]
            (refused,) = [a for a in accounts if a["name"] == "refused"]
            assert refused["state"] == "cooled"
    return sum(1 for r in provider.requests if r.key == "refused-key")


def test_two_workers_try_a_refused_key_once_in_total(
    mock: tuple[MockProvider, str], redis_server: RedisServer, tmp_path: Path
) -> None:
    state = f"""
    [state]
    backend = "redis"
    url = "{redis_server.url}"
    key_prefix = "gateway-live"
    """
    assert refused_tries(20, mock, tmp_path, state, shared=True) == 1


def test_control_without_redis_each_worker_tries_the_refused_key(
    mock: tuple[MockProvider, str], tmp_path: Path
) -> None:
    """The same traffic on per-process state: the key is tried once per worker. Shows the test
    above really spreads requests over both workers."""
    tries = refused_tries(20, mock, tmp_path, "", shared=False)
    if tries == 1:
        pytest.skip("the kernel handed every connection to one worker: the control says nothing")
    assert tries == 2


def test_two_workers_share_a_throttle_hold(
    mock: tuple[MockProvider, str], redis_server: RedisServer, tmp_path: Path
) -> None:
    """One worker sees the 429 that says "retry in 30 s"; whichever worker takes the next
    requests skips that key too, and so does a gateway started afterwards."""
    provider, url = mock
    provider.reset()
    provider.set_behaviour("refused-key", Behaviour(status=429, headers={"retry-after": "30"}))
    state = f"""
    [state]
    backend = "redis"
    url = "{redis_server.url}"
    key_prefix = "hold-live"
    """
    env = {"KEY_REFUSED": "refused-key", "KEY_GOOD": "good-key"}
    config = gateway_config(url, state)
    with example_gateway(config, tmp_path, env, workers=2) as gateway:
        # Both workers connected (one still connecting would read the hold once connected,
        # but meanwhile route on what it knows).
        time.sleep(2.0)
        first = ask(gateway)
        assert first.headers["x-switchyard-attempts"] == "2"  # the 429, then the good key
        time.sleep(0.2)  # the hold travels through Redis in milliseconds
        for _ in range(20):
            response = ask(gateway)
            assert response.headers["x-switchyard-attempts"] == "1"
            assert response.headers["x-switchyard-account"] == "good"
        for _ in range(10):  # whichever worker answers shows the hold
            accounts = httpx.get(f"{gateway}/switchyard/accounts").json()["accounts"]
            (refused,) = [a for a in accounts if a["name"] == "refused"]
            assert 20 < refused["held_for_secs"]["claude-shared"] <= 30
        # A gateway started now (a pod scaled up) reads the hold in force as it connects.
        (tmp_path / "late").mkdir()
        with example_gateway(config, tmp_path / "late", env) as late:
            assert 15 < held_for_secs(late, "refused", "claude-shared") <= 30
            for _ in range(5):
                response = ask(late)
                assert response.headers["x-switchyard-attempts"] == "1"
                assert response.headers["x-switchyard-account"] == "good"
    assert sum(1 for r in provider.requests if r.key == "refused-key") == 1


def held_for_secs(gateway: str, name: str, model: str, within: float = 5.0) -> float:
    """The hold of account `name` for `model` as the gateway shows it, once it shows one."""
    end = time.monotonic() + within
    while True:
        accounts = httpx.get(f"{gateway}/switchyard/accounts").json()["accounts"]
        (found,) = [a for a in accounts if a["name"] == name]
        if model in found["held_for_secs"]:
            return float(found["held_for_secs"][model])
        assert time.monotonic() < end, f"{gateway} shows no hold of {name} for {model}"
        time.sleep(0.02)


GUARDED = """
[state]
backend = "redis"
url = "{redis}"
key_prefix = "guard-live"

[llm_clients.base-acct]
base_url = "{mock}"
api_key_env = "KEY_GOOD"
auth = "x-api-key"
models = ["g-base"]

[llm_clients.var-acct]
base_url = "{mock}"
api_key_env = "KEY_REFUSED"
auth = "x-api-key"
models = ["g-var"]
failure_threshold = 100000

[canaries."g-base"]
variants = {{ "g-var" = 50.0 }}
guard = {{ max_fault_rate = 0.2, min_requests = 10, window_secs = 60 }}
"""


def test_two_workers_trip_a_guard_together(
    mock: tuple[MockProvider, str], redis_server: RedisServer, tmp_path: Path
) -> None:
    provider, url = mock
    provider.reset()
    provider.set_behaviour("refused-key", Behaviour(status=500))
    env = {"KEY_REFUSED": "refused-key", "KEY_GOOD": "good-key"}
    config = GUARDED.format(redis=redis_server.url, mock=url)
    messages = [{"role": "user", "content": "hi"}]
    with example_gateway(config, tmp_path, env, workers=2) as gateway:
        time.sleep(2.0)  # both workers connected
        tripped_on: set[int] = set()
        for i in range(200):
            body = {
                "model": "g-base",
                "max_tokens": 8,
                "messages": messages,
                "metadata": {"user_id": f"user-{i}"},
            }
            with httpx.Client(base_url=gateway, timeout=10) as client:
                assert client.post("/v1/messages", json=body).status_code == 200
            health = httpx.get(f"{gateway}/switchyard/canaries").json()["canaries"]
            if health[0]["tripped"]:
                tripped_on.add(i)
                break
        assert tripped_on, "the guard never tripped"
        time.sleep(0.2)
        # Every worker now has it tripped, whichever of them counted the faults.
        for _ in range(20):
            (canary,) = httpx.get(f"{gateway}/switchyard/canaries").json()["canaries"]
            assert canary["tripped"] == ["g-var"]
        # A gateway started now, with the same canary, has it tripped too.
        (tmp_path / "late").mkdir()
        with example_gateway(config, tmp_path / "late", env) as late:
            end = time.monotonic() + 5
            while not httpx.get(f"{late}/switchyard/canaries").json()["canaries"][0]["tripped"]:
                assert time.monotonic() < end, "the late gateway never applied the trip"
                time.sleep(0.02)
