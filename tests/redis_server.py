"""A real `redis-server` for tests: a subprocess on a free loopback port, nothing on disk.

Tests skip when `redis-server` is not installed, unless SWITCHYARD_REQUIRE_REDIS=1 (set by
`.ci/run`, which installs it): there a missing server is a failure, not a silent skip.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from servers import free_port, wait_for_port


def _binary(name: str) -> str:
    """A Redis binary's path; missing: a skip, or a failure where CI requires Redis."""
    path = shutil.which(name)
    if path is None:
        if os.environ.get("SWITCHYARD_REQUIRE_REDIS") == "1":
            pytest.fail(f"{name} is not installed (SWITCHYARD_REQUIRE_REDIS=1)")
        pytest.skip(f"{name} is not installed")
    return path


def redis_server_path() -> str:
    path = shutil.which("redis-server")
    if path is None:
        if os.environ.get("SWITCHYARD_REQUIRE_REDIS") == "1":
            pytest.fail("redis-server is not installed (SWITCHYARD_REQUIRE_REDIS=1)")
        pytest.skip("redis-server is not installed")
    return path


class RedisServer:
    """One `redis-server` process that a test may kill, pause and start again on its port."""

    def __init__(self, workdir: Path) -> None:
        self.binary = redis_server_path()
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        # No RDB, no AOF: a restart comes back empty, the worst case for a resync.
        command = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        command += ["--save", "", "--appendonly", "no", "--dir", str(self.workdir)]
        log = (self.workdir / "redis.log").open("ab")
        self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        wait_for_port(self.port)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def pause(self) -> None:
        """SIGSTOP: the port stays open but nothing answers (a slow, hung Redis)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)


def running_redis(workdir: Path) -> Iterator[RedisServer]:
    server = RedisServer(workdir)
    server.start()
    try:
        yield server
    finally:
        if server.proc is not None:
            server.resume()  # a stopped process would not die of SIGKILL until continued
        server.kill()


async def until(check: Callable[[], bool], within: float = 5.0) -> float:
    """Poll `check` every millisecond; the seconds it took to hold."""
    start = time.perf_counter()
    while not check():
        if time.perf_counter() - start > within:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.001)
    return time.perf_counter() - start


def _redis_cli(port: int, *args: str, timeout: float = 30.0) -> str:
    binary = _binary("redis-cli")
    command = [binary, "-h", "127.0.0.1", "-p", str(port), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=True)
    return done.stdout


def distinct_free_ports(count: int) -> list[int]:
    """`count` free loopback ports, all different: each is held open until all are chosen
    (ports picked one at a time may repeat, and a node then cannot bind its port)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


class ClusterNode(RedisServer):
    """One node of a Redis Cluster; its `nodes.conf` stays in its directory across restarts."""

    def __init__(self, workdir: Path, *, node_timeout_ms: int) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        super().__init__(workdir)
        self.bus_port = free_port()  # set explicitly: port + 10000 may be taken or too high
        self.node_timeout_ms = node_timeout_ms

    def start(self) -> None:
        command = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        command += ["--save", "", "--appendonly", "no", "--dir", str(self.workdir)]
        command += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        command += ["--cluster-port", str(self.bus_port)]
        command += ["--cluster-node-timeout", str(self.node_timeout_ms)]
        # A replica takes over however long it was cut off from its master.
        command += ["--cluster-replica-validity-factor", "0"]
        log = (self.workdir / "redis.log").open("ab")
        self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        try:
            wait_for_port(self.port)
        except TimeoutError:
            log_text = (self.workdir / "redis.log").read_text(errors="replace")[-2000:]
            raise TimeoutError(f"cluster node on {self.port} did not start:\n{log_text}") from None

    def cli(self, *args: str) -> str:
        return _redis_cli(self.port, *args)

    def info(self, section: str) -> dict[str, str]:
        lines = self.cli("info", section).splitlines()
        return dict(line.split(":", 1) for line in lines if ":" in line)


class RedisCluster:
    """Three masters and three replicas on loopback (`redis-cli --cluster create`)."""

    def __init__(self, workdir: Path, *, node_timeout_ms: int = 1000) -> None:
        self.nodes = [
            ClusterNode(workdir / f"node{i}", node_timeout_ms=node_timeout_ms) for i in range(6)
        ]
        ports = distinct_free_ports(2 * len(self.nodes))
        for node, port, bus in zip(self.nodes, ports[::2], ports[1::2], strict=True):
            node.port, node.bus_port = port, bus

    @property
    def url(self) -> str:
        return self.nodes[0].url.removesuffix("/0")

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        _redis_cli(
            self.nodes[0].port,
            "--cluster", "create", *addresses, "--cluster-replicas", "1", "--cluster-yes",
            timeout=60,
        )  # fmt: skip
        self.wait_healthy()

    def stop(self) -> None:
        for node in self.nodes:
            if node.proc is not None:
                node.resume()
            node.kill()

    def running(self) -> list[ClusterNode]:
        return [node for node in self.nodes if node.proc is not None]

    def wait_healthy(self, within: float = 30.0) -> None:
        """Every running node sees every slot served and each master has a synced replica."""
        end = time.monotonic() + within
        while time.monotonic() < end:
            if all(self._healthy(node) for node in self.running()):
                return
            time.sleep(0.1)
        raise AssertionError("the cluster did not settle in time")

    def _healthy(self, node: ClusterNode) -> bool:
        if "cluster_state:ok" not in node.cli("cluster", "info"):
            return False
        replication = node.info("replication")
        if replication.get("role") == "slave":
            return replication.get("master_link_status") == "up"
        return True

    def master_of(self, key: str) -> ClusterNode:
        """The running node that serves `key`'s slot now."""
        slot = int(self.running()[0].cli("cluster", "keyslot", key))
        for node in self.running():
            for line in node.cli("cluster", "nodes").splitlines():
                fields = line.split()
                if "myself" in fields[2] and "master" in fields[2] and _serves(fields[8:], slot):
                    return node
        raise AssertionError(f"no running master serves slot {slot}")

    def first_slot(self, node: ClusterNode) -> int:
        """The lowest slot `node` serves (a master)."""
        line = next(line for line in node.cli("cluster", "nodes").splitlines() if "myself" in line)
        return min(int(item.partition("-")[0]) for item in line.split()[8:] if item[0] != "[")

    def move_slot_of(self, key: str) -> ClusterNode:
        """`redis-cli --cluster reshard`: the slots of `key`'s master up to `key`'s slot move to
        another master (reshard takes a master's slots from its lowest); the new master."""
        source = self.master_of(key)
        slot = int(source.cli("cluster", "keyslot", key))
        target = next(
            node
            for node in self.running()
            if node is not source and node.info("replication").get("role") == "master"
        )
        count = slot - self.first_slot(source) + 1
        _redis_cli(
            source.port,
            "--cluster", "reshard", f"127.0.0.1:{source.port}",
            "--cluster-from", source.cli("cluster", "myid").strip(),
            "--cluster-to", target.cli("cluster", "myid").strip(),
            "--cluster-slots", str(count), "--cluster-yes",
            timeout=120,
        )  # fmt: skip
        return target


def _serves(ranges: list[str], slot: int) -> bool:
    for item in ranges:
        if item.startswith("["):
            continue  # a slot being migrated or imported
        low, _, high = item.partition("-")
        if int(low) <= slot <= int(high or low):
            return True
    return False


def running_cluster(workdir: Path) -> Iterator[RedisCluster]:
    cluster = RedisCluster(workdir)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


class SentinelGroup:
    """One master, one replica, three sentinels watching them as `mymaster`."""

    service = "mymaster"

    def __init__(self, workdir: Path) -> None:
        self.master = RedisServer(workdir / "master")
        self.replica = RedisServer(workdir / "replica")
        self.workdir = workdir
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.sentinel_procs: list[subprocess.Popen[bytes]] = []

    @property
    def sentinels(self) -> list[str]:
        return [f"127.0.0.1:{port}" for port in self.sentinel_ports]

    def start(self) -> None:
        for server in (self.master, self.replica):
            server.workdir.mkdir(parents=True, exist_ok=True)
        self.master.start()
        self.replica.start()
        _redis_cli(self.replica.port, "replicaof", "127.0.0.1", str(self.master.port))
        for i, port in enumerate(self.sentinel_ports):
            self.sentinel_procs.append(self._start_sentinel(i, port))
        self.wait_for(self.settled)

    def _start_sentinel(self, i: int, port: int) -> subprocess.Popen[bytes]:
        conf = self.workdir / f"sentinel{i}.conf"  # the sentinel rewrites it: a file of its own
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {self.workdir}\n"
            f"sentinel monitor {self.service} 127.0.0.1 {self.master.port} 2\n"
            f"sentinel down-after-milliseconds {self.service} 500\n"
            f"sentinel failover-timeout {self.service} 2000\n"
        )
        binary = _binary("redis-sentinel")
        log = (self.workdir / f"sentinel{i}.log").open("ab")
        proc = subprocess.Popen([binary, str(conf)], stdout=log, stderr=subprocess.STDOUT)
        log.close()
        wait_for_port(port)
        return proc

    def master_port(self) -> int:
        """The master's port as the first sentinel names it now."""
        out = _redis_cli(
            self.sentinel_ports[0], "sentinel", "get-master-addr-by-name", self.service
        )
        return int(out.split()[1])

    def settled(self) -> bool:
        """Every sentinel knows the replica and the two other sentinels."""
        for port in self.sentinel_ports:
            fields = _redis_cli(port, "sentinel", "master", self.service).split("\n")
            master = dict(zip(fields[::2], fields[1::2], strict=False))
            if master.get("num-slaves") != "1" or master.get("num-other-sentinels") != "2":
                return False
        return True

    def wait_for(self, check: Callable[[], bool], within: float = 30.0) -> None:
        end = time.monotonic() + within
        while not check():
            if time.monotonic() > end:
                raise AssertionError("sentinels did not settle in time")
            time.sleep(0.1)

    def stop(self) -> None:
        for proc in self.sentinel_procs:
            proc.kill()
            proc.wait(10)
        for server in (self.master, self.replica):
            if server.proc is not None:
                server.resume()
            server.kill()


def running_sentinels(workdir: Path) -> Iterator[SentinelGroup]:
    group = SentinelGroup(workdir)
    try:
        group.start()
        yield group
    finally:
        group.stop()
