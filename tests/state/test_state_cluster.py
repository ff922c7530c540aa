"""Shared state on a Redis Cluster (3 masters, 3 replicas, all on loopback): two example
gateways under uvicorn share a cooling and a probe slot, through a master's failover and
through the migration of an account's slot; two ext_proc workers share a cooling; holds and
trips in force reach a replica that starts later, whichever master their keys live on.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc  # type: ignore[import-untyped]  # grpcio ships no type hints
import httpx
import pytest
import redis
from redis.crc import key_slot
from test_state_held import Replica, specs, started

from extproc_helpers import request_body, request_headers, response_headers, sets
from redis_server import ClusterNode, RedisCluster, running_cluster
from servers import example_gateway, metric_value, serve_in_thread
from switchyard_mw._protos.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from switchyard_mw.state.redis_store import RedisStore
from switchyard_mw.testing import Behaviour, MockProvider

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    yield from running_cluster(tmp_path_factory.mktemp("cluster"))


@pytest.fixture(scope="module")
def mock() -> Iterator[tuple[MockProvider, str]]:
    provider = MockProvider()
    with serve_in_thread(provider) as url:
        yield provider, url


def gateway_config(mock_url: str, state: str) -> str:
    """Accounts x, p and y (refused when the mock says so) in front of good, which always
    answers. p cools for 2 s first, so that a test can reach its probe."""
    text = textwrap.dedent(state)
    for name, priority, cooldown in (("x", 0, 300), ("p", 1, 2), ("y", 2, 300), ("good", 3, 300)):
        text += textwrap.dedent(f"""
        [llm_clients.{name}]
        base_url = "{mock_url}"
        api_key_env = "KEY_{name.upper()}"
        auth = "x-api-key"
        models = ["claude-shared"]
        priority = {priority}
        failure_threshold = 1
        cooldown_secs = {cooldown}
        max_cooldown_secs = 600
        """)
    return text


KEYS = {"KEY_X": "kx", "KEY_P": "kp", "KEY_Y": "ky", "KEY_GOOD": "kgood"}


def cluster_state(cluster: RedisCluster, prefix: str) -> str:
    return f"""
    [state]
    backend = "redis"
    mode = "cluster"
    url = "{cluster.url}"
    key_prefix = "{prefix}"
    """


def ask(gateway: str) -> httpx.Response:
    messages = [{"role": "user", "content": "hi"}]
    body = {"model": "claude-shared", "max_tokens": 16, "messages": messages}
    with httpx.Client(base_url=gateway, timeout=10) as client:
        return client.post("/v1/messages", json=body, headers={"x-api-key": "caller"})


def account(gateway: str, name: str) -> dict[str, object]:
    accounts = httpx.get(f"{gateway}/switchyard/accounts", timeout=10).json()["accounts"]
    (found,) = [a for a in accounts if a["name"] == name]
    return dict(found)


def wait_until(check: object, within: float, what: str) -> None:
    end = time.monotonic() + within
    while not check():  # type: ignore[operator]
        assert time.monotonic() < end, what
        time.sleep(0.02)


def tries(provider: MockProvider, key: str) -> int:
    return sum(1 for r in provider.requests if r.key == key)


@contextlib.contextmanager
def two_gateways(config: str, tmp_path: Path) -> Iterator[tuple[str, str]]:
    with (
        example_gateway(config, tmp_path / "a", KEYS) as a,
        example_gateway(config, tmp_path / "b", KEYS) as b,
    ):
        yield a, b


def replica_copy(cluster: RedisCluster, key: str) -> dict[str, str]:
    """The hash `key` as the replica of its master holds it (READONLY on a replica)."""
    master = cluster.master_of(key)
    master_id = master.cli("cluster", "myid").strip()
    for node in cluster.running():
        if f"slave {master_id}" in node.cli("cluster", "nodes").split("myself", 1)[1][:120]:
            client = redis.Redis(port=node.port, decode_responses=True)
            with client:
                client.readonly()
                found: dict[str, str] = client.hgetall(key)  # type: ignore[assignment]
                return found
    raise AssertionError(f"no replica of {master.port} runs")


def test_two_gateways_share_a_cooling_and_a_probe_through_a_failover(
    cluster: RedisCluster, mock: tuple[MockProvider, str], tmp_path: Path
) -> None:
    provider, url = mock
    provider.reset()
    provider.set_behaviour("kx", Behaviour(status=401))
    provider.set_behaviour("kp", Behaviour(status=401))
    config = gateway_config(url, cluster_state(cluster, "fo"))
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    with two_gateways(config, tmp_path) as (a, b):
        # One gateway meets the refusals; the other hears of them and never tries x.
        assert ask(a).headers["x-switchyard-account"] == "y"
        wait_until(lambda: account(b, "x")["state"] == "cooled", 5, "b never saw x cooled")
        for gateway in (a, b) * 3:
            assert ask(gateway).status_code == 200
        assert tries(provider, "kx") == 1
        # p's cooling ends for both at once: one probe between them, which fails again.
        wait_until(lambda: account(a, "p")["probe_due"] is True, 10, "p still cooled")
        probes, period = tries(provider, "kp"), account(a, "p")["current_cooldown_secs"]
        for gateway in (a, b):
            assert ask(gateway).status_code == 200
        assert tries(provider, "kp") == probes + 1
        # (p may have been probed before, during the requests above: its period, doubled.)
        doubled = 2 * period  # type: ignore[operator]
        wait_until(lambda: account(b, "p")["current_cooldown_secs"] == doubled, 5, "b missed it")

        # The master of x's slot dies; its replica takes over. Meanwhile: local state.
        key = "fo:account:{x}"
        wait_until(lambda: replica_copy(cluster, key).get("faults") == "1", 5, "no copy")
        copy = replica_copy(cluster, key)
        victim = cluster.master_of(key)
        victim.kill()
        answered = 0
        end = time.monotonic() + 30
        while not _promoted(cluster, key, victim.port):
            assert time.monotonic() < end, "no replica took over"
            for gateway in (a, b) * 5:
                assert ask(gateway).status_code == 200
                answered += 1
        print(f"{answered} requests answered during the failover")

        # Nothing the replica had is lost: x's cooling is there, and nobody tried x again.
        survivor = redis.Redis(port=cluster.master_of(key).port, decode_responses=True)
        with survivor:
            assert_kept(survivor.hgetall(key), copy)  # type: ignore[arg-type]
        # Shared again once the stores reconnected: y refused on b is known to a.
        provider.set_behaviour("ky", Behaviour(status=401))
        before = tries(provider, "ky")
        wait_until(lambda: _cools_y(b), 15, "y never cooled on b")
        wait_until(lambda: account(a, "y")["state"] == "cooled", 10, "a never heard of y")
        for gateway in (a, b) * 3:
            assert ask(gateway).headers["x-switchyard-account"] == "good"
        assert tries(provider, "ky") == before + 1
        assert tries(provider, "kx") == 1
    victim.start()  # back as a replica of the node that took over
    cluster.wait_healthy()


def assert_kept(now: dict[str, str], copy: dict[str, str]) -> None:
    """Every field at least what the replica had: the stores' resync may have merged a later
    local end into it (by max), never an earlier one."""
    assert copy.keys() == {"faults", "period_ms", "until_ms", "cause", "since_ms"}
    assert now.keys() == copy.keys()
    assert now["cause"] == copy["cause"]
    numbers = ("faults", "period_ms", "until_ms")
    assert all(int(now[field]) >= int(copy[field]) for field in numbers), (now, copy)


def _promoted(cluster: RedisCluster, key: str, old: int) -> bool:
    try:
        return cluster.master_of(key).port != old and all(
            "cluster_state:ok" in node.cli("cluster", "info") for node in cluster.running()
        )
    except AssertionError:
        return False


def _cools_y(gateway: str) -> bool:
    ask(gateway)
    return account(gateway, "y")["state"] == "cooled"


def near_a_range_start(cluster: RedisCluster, prefix: str) -> str:
    """An account name whose slot is among the first 20 of its master's: resharding it moves
    few slots."""
    starts = [cluster.first_slot(node) for node in _masters(cluster)]
    for i in range(100_000):
        slot = key_slot(f"{prefix}:account:{{m{i}}}".encode())
        if any(0 <= slot - start < 20 for start in starts):
            return f"m{i}"
    raise AssertionError("no name found")


def _masters(cluster: RedisCluster) -> list[ClusterNode]:
    return [n for n in cluster.running() if n.info("replication").get("role") == "master"]


def test_a_slot_migration_under_traffic_fails_no_request(
    cluster: RedisCluster, mock: tuple[MockProvider, str], tmp_path: Path
) -> None:
    provider, url = mock
    provider.reset()
    name = near_a_range_start(cluster, "mig")
    provider.set_behaviour("km", Behaviour(status=401))
    config = textwrap.dedent(cluster_state(cluster, "mig"))
    for account_name, key_env, priority, cooldown in (
        (name, "KEY_M", 0, 0.2),
        ("x", "KEY_X", 1, 300),
    ):
        config += textwrap.dedent(f"""
        [llm_clients.{account_name}]
        base_url = "{url}"
        api_key_env = "{key_env}"
        auth = "x-api-key"
        models = ["claude-shared"]
        priority = {priority}
        failure_threshold = 1
        cooldown_secs = {cooldown}
        """)
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    env = {**KEYS, "KEY_M": "km"}
    key = f"mig:account:{{{name}}}"
    with (
        example_gateway(config, tmp_path / "a", env) as a,
        example_gateway(config, tmp_path / "b", env) as b,
    ):
        stop = threading.Event()
        failures: list[str] = []
        answered = [0]

        def traffic() -> None:
            # m cools for 0.2 s, is probed, cools again: a write to its keys every few
            # requests, while its slot moves.
            while not stop.is_set():
                for gateway in (a, b):
                    response = ask(gateway)
                    answered[0] += 1
                    if response.status_code != 200:
                        failures.append(response.text)

        node = cluster.master_of("mig:events")
        wait_until(lambda: subscribers(node, "mig:events") == 2, 20, "gateways not connected")
        # A start-up connect slower than its bound counts one outage: not the migration's.
        outages = [metric_value(gateway, "switchyard_state_degraded_total") for gateway in (a, b)]
        thread = threading.Thread(target=traffic)
        thread.start()
        try:
            before = cluster.master_of(key)
            wait_until(lambda: tries(provider, "km") >= 3, 20, "m never probed")
            after = cluster.move_slot_of(key)
            moved_at = answered[0]
            wait_until(lambda: answered[0] >= moved_at + 20, 20, "traffic stopped")
        finally:
            stop.set()
            thread.join(30)
        assert after.port != before.port
        assert cluster.master_of(key).port == after.port
        assert failures == []
        print(f"{answered[0]} requests during the migration, {tries(provider, 'km')} to m")
        assert [metric_value(g, "switchyard_state_degraded_total") for g in (a, b)] == outages
        # Still shared after the move: m's probes come from one gateway at a time.
        assert (
            account(a, name)["current_cooldown_secs"] == account(b, name)["current_cooldown_secs"]
        )


EXTPROC = """
[state]
backend = "redis"
mode = "cluster"
url = "{url}"
key_prefix = "workers"

[llm_clients.a]
base_url = "https://prov.example"
api_key_env = "KEY_A"
models = ["m"]
failure_threshold = 1
cooldown_secs = 300
envoy_cluster = "prov"

[llm_clients.b]
base_url = "https://prov.example"
api_key_env = "KEY_B"
models = ["m"]
priority = 1
envoy_cluster = "prov"
"""


@contextlib.contextmanager
def extproc_workers(config: str, tmp_path: Path) -> Iterator[int]:
    """`switchyard-mw extproc --workers 2` on a free port; yields the port."""
    path = tmp_path / "sy.toml"
    path.write_text(config)
    command = [sys.executable, "-m", "switchyard_mw.cli", "extproc", "--config", str(path)]
    proc = subprocess.Popen(
        [*command, "--listen", "127.0.0.1:0", "--workers", "2"],
        env={**os.environ, "KEY_A": "ka", "KEY_B": "kb"},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        # A worker whose first connect outlasts its bound on a loaded machine says so first
        # (and connects again): the listening line may come after such lines.
        seen = []
        for _ in range(20):
            line = proc.stderr.readline()
            seen.append(line)
            if line.rstrip().endswith("(2 workers)"):
                break
        else:
            raise AssertionError("".join(seen))
        yield int(line.split("127.0.0.1:")[1].split()[0])
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_two_extproc_workers_share_a_cooling(cluster: RedisCluster, tmp_path: Path) -> None:
    payload = b'{"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "q"}]}'
    keys: list[bytes] = []
    with extproc_workers(EXTPROC.format(url=cluster.url), tmp_path) as port:
        # Both workers subscribed (then they read the shared state: a moment more).
        node = cluster.master_of("workers:events")
        wait_until(lambda: subscribers(node, "workers:events") == 2, 20, "workers not connected")
        time.sleep(0.5)
        # One channel is one connection, which the kernel hands to either worker (SO_REUSEPORT
        # hashes the client port): 20 of them reach both workers but for a 2^-19 chance.
        for _ in range(20):
            with grpc.insecure_channel(
                f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)]
            ) as channel:
                keys.append(routed(ep_grpc.ExternalProcessorStub(channel), payload))
            time.sleep(0.05)  # room for the cooling to reach the other worker
    # a refused once, in one worker; neither worker sent it anything again.
    assert keys.count(b"Bearer ka") == 1, keys


def routed(stub: ep_grpc.ExternalProcessorStub, payload: bytes) -> bytes:
    """One request; the key it was given; the upstream refuses ka (401) and takes kb."""
    verdict: queue.Queue[bytes] = queue.Queue()

    def messages() -> Iterator[object]:
        yield request_headers()
        yield request_body(payload)
        yield response_headers(401 if verdict.get(timeout=10) == b"Bearer ka" else 200)

    answers = stub.Process(messages())
    next(answers)
    key = sets(next(answers))["authorization"]
    verdict.put(key)
    list(answers)
    return key


def subscribers(node: ClusterNode, channel: str) -> int:
    return int(node.cli("pubsub", "numsub", channel).split()[1])


HELD = ("x", "p", "y", "good", "a1", "a2", "a3", "a4")


async def test_holds_and_trips_in_force_reach_a_replica_started_later(
    cluster: RedisCluster,
) -> None:
    """Each account's holds are one key in its own slot; the replica reads them key by key."""
    masters = {cluster.master_of(f"held:holds:{{{name}}}").port for name in HELD}
    assert len(masters) > 1, "the accounts' keys all fell on one master: pick other names"
    stores: list[RedisStore] = []

    async def replica(**kw: object) -> Replica:
        store = RedisStore(cluster.url, mode="cluster", key_prefix="held", reconnect_max_secs=0.2)
        stores.append(store)
        return await started(store, *specs(*HELD), **kw)  # type: ignore[arg-type]

    try:
        a = await replica()
        held_at = time.monotonic()
        for name in HELD:
            a.hold(name, "m", 30.0)
        a.hold("x", "short", 0.3)
        a.canaries.trip("base", "var-a")
        await asyncio.sleep(0.6)  # written, and the short hold over

        late = await replica()
        left = 30 - (time.monotonic() - held_at)  # what is left of the holds now, at most
        for name in HELD:
            assert left - 1 < late.held_for(name, "m") <= left + 0.05, name  # ms rounded
        assert late.held_for("x", "short") == 0
        assert late.canaries.tripped("base", "var-a")
        assert not late.canaries.tripped("base", "var-b")
        node = cluster.master_of("held:holds:{x}")
        assert (left - 1) * 1000 < int(node.cli("pttl", "held:holds:{x}")) <= (left + 0.05) * 1000
        assert node.cli("zrange", "held:holds:{x}", "0", "-1").split() == ["m"]
    finally:
        for store in stores:
            await store.aclose()
