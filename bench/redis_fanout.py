"""What shared cooling costs Redis and the fleet, for N = 2…8 gateway processes.

    python bench/redis_fanout.py                      # standalone redis-server, N = 2..8
    python bench/redis_fanout.py --mode cluster       # 3 masters + 3 replicas, classic pub/sub
    python bench/redis_fanout.py --sharded-compare    # cluster: PUBLISH vs SPUBLISH, raw

Starts its own `redis-server` (Debian's; a cluster with `redis-cli --cluster create`) on free
loopback ports in a temp dir, and stops it. For each N, N processes each run a `RedisStore`
(the one the gateways use) on M accounts; one of them, this process, emits `--rate` events a
second for `--secs` seconds: one account change each (a fault counted: one script run, one
message), round robin over the accounts. Measured over the window, from /proc: the CPU the
Redis server(s) spent per event, and the CPU each receiving process spent per event; and the
messages each process received (N per event: every process hears every change).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")

RECEIVER = """
import asyncio, sys, time
from switchyard_mw.core.pool import AccountPool, AccountSpec
from switchyard_mw.state.redis_store import RedisStore

class Counting(AccountPool):
    seen = 0
    def merge(self, name, shared):
        Counting.seen += 1
        super().merge(name, shared)

async def main() -> None:
    url, mode, accounts = sys.argv[1], sys.argv[2], int(sys.argv[3])
    specs = [AccountSpec(name=f"a{i}", models=frozenset({"m"}), failure_threshold=10**9)
             for i in range(accounts)]
    pool = Counting(specs)
    store = RedisStore(url, mode=mode, key_prefix="fan", timeout_secs=1.0)
    store.bind(pool)
    await store.start()
    while not store.healthy:
        await asyncio.sleep(0.01)
    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.readline)
    seen, cpu = Counting.seen, time.process_time()
    await loop.run_in_executor(None, sys.stdin.readline)
    print(Counting.seen - seen, time.process_time() - cpu, flush=True)
    await store.aclose()

asyncio.run(main())
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_for_port(port: int) -> None:
    end = time.monotonic() + 15
    while time.monotonic() < end:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing on port {port}")


def cpu_secs(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def idle_cpu_per_sec(pids: list[int], secs: float = 2.0) -> float:
    """What the servers spend with nothing to do (a cluster gossips and runs its cron)."""
    before = sum(cpu_secs(pid) for pid in pids)
    time.sleep(secs)
    return (sum(cpu_secs(pid) for pid in pids) - before) / secs


def cli(port: int, *args: str) -> str:
    command = ["redis-cli", "-p", str(port), *args]
    return subprocess.run(command, capture_output=True, text=True, check=True, timeout=60).stdout


@contextlib.contextmanager
def redis_servers(workdir: Path, *, cluster: bool) -> Iterator[list[tuple[int, int]]]:
    """(port, pid) of each server: one, or a 3-master 3-replica cluster."""
    procs: list[subprocess.Popen[bytes]] = []
    servers: list[tuple[int, int]] = []
    try:
        for _i in range(6 if cluster else 1):
            port = free_port()
            (workdir / str(port)).mkdir()
            command = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
            command += ["--appendonly", "no", "--dir", str(workdir / str(port))]
            if cluster:
                command += ["--cluster-enabled", "yes", "--cluster-port", str(free_port())]
            procs.append(subprocess.Popen(command, stdout=subprocess.DEVNULL))
            wait_for_port(port)
            servers.append((port, procs[-1].pid))
        if cluster:
            addresses = [f"127.0.0.1:{port}" for port, _ in servers]
            cli(servers[0][0], "--cluster", "create", *addresses, "--cluster-replicas", "1",
                "--cluster-yes")  # fmt: skip
            while any("cluster_state:ok" not in cli(p, "cluster", "info") for p, _ in servers):
                time.sleep(0.1)
        yield servers
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


async def drive(url: str, mode: str, accounts: int, rate: int, secs: float) -> tuple[int, float]:
    """Emit `rate` changes a second for `secs` from a store of our own; (events, our CPU s)."""
    from switchyard_mw.core.pool import AccountPool, AccountSpec
    from switchyard_mw.core.shared import Change, Shared
    from switchyard_mw.state.redis_store import RedisStore

    specs = [
        AccountSpec(name=f"a{i}", models=frozenset({"m"}), failure_threshold=10**9)
        for i in range(accounts)
    ]
    store = RedisStore(url, mode=mode, key_prefix="fan", timeout_secs=1.0)  # type: ignore[arg-type]
    store.bind(AccountPool(specs))
    await store.start()
    while not store.healthy:  # noqa: ASYNC110  # the store has no event to wait on
        await asyncio.sleep(0.01)
    sent, start, cpu = 0, time.monotonic(), time.process_time()
    while (elapsed := time.monotonic() - start) < secs:
        while sent < elapsed * rate:
            store.changed(f"a{sent % accounts}", Change.FAULT, Shared(sent, 30.0))
            sent += 1
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.5)  # the last messages arrive
    cpu = time.process_time() - cpu
    await store.aclose()
    return sent, cpu


def measure(
    url: str, mode: str, n: int, args: argparse.Namespace, pids: list[int]
) -> dict[str, float]:
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    receivers = [
        subprocess.Popen(
            [sys.executable, "-c", RECEIVER, url, mode, str(args.accounts)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(n - 1)
    ]
    try:
        for proc in receivers:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "ready"
        for proc in receivers:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        idle = idle_cpu_per_sec(pids)
        redis_cpu, start = sum(cpu_secs(pid) for pid in pids), time.monotonic()
        events, own_cpu = asyncio.run(drive(url, mode, args.accounts, args.rate, args.secs))
        redis_cpu = sum(cpu_secs(pid) for pid in pids) - redis_cpu
        redis_cpu -= idle * (time.monotonic() - start)  # a cluster's own chatter, cron
        seen, cpus = [], []
        for proc in receivers:
            assert proc.stdin is not None
            assert proc.stdout is not None
            proc.stdin.write("stop\n")
            proc.stdin.flush()
            got, cpu = proc.stdout.readline().split()
            seen.append(int(got))
            cpus.append(float(cpu))
    finally:
        for proc in receivers:
            proc.wait(30)
    return {
        "n": n,
        "events": events,
        "delivered": min(seen) / events if seen else 1.0,
        "redis_us": redis_cpu / events * 1e6,
        "receiver_us": sum(cpus) / len(cpus) / events * 1e6 if cpus else 0.0,
        "sender_us": own_cpu / events * 1e6,
    }


def fanout(args: argparse.Namespace) -> None:
    cluster = args.mode == "cluster"
    with tempfile.TemporaryDirectory() as tmp, redis_servers(Path(tmp), cluster=cluster) as servers:
        url = f"redis://127.0.0.1:{servers[0][0]}"
        pids = [pid for _, pid in servers]
        print(f"mode {args.mode}, {args.accounts} accounts, {args.rate} events/s for {args.secs} s")
        print(
            "| N | events | each process got | Redis CPU µs/event | receiver CPU µs/event "
            "| sender CPU µs/event |"
        )
        print("|---|---|---|---|---|---|")
        for n in range(args.min, args.max + 1):
            r = measure(url, args.mode, n, args, pids)
            print(
                f"| {n} | {r['events']:.0f} | {r['delivered']:.0%} | {r['redis_us']:.1f} "
                f"| {r['receiver_us']:.1f} | {r['sender_us']:.1f} |",
                flush=True,
            )


PUBLISHER = {
    # The store's script publishes where its keys are; the two ways a cluster can carry that.
    "PUBLISH": "redis.call('HINCRBY', KEYS[1], 'faults', 1) "
    "return redis.call('PUBLISH', ARGV[1], ARGV[2])",
    "SPUBLISH": "redis.call('HINCRBY', KEYS[1], 'faults', 1) "
    "return redis.call('SPUBLISH', KEYS[2], ARGV[2])",
}


def bus_messages(ports: list[int]) -> int:
    total = 0
    for port in ports:
        for line in cli(port, "cluster", "info").splitlines():
            if line.startswith(
                ("cluster_stats_messages_publish", "cluster_stats_messages_publishshard")
            ):
                total += int(line.split(":")[1]) if "_sent" in line else 0
    return total


def sharded_compare(args: argparse.Namespace) -> None:
    """Classic vs sharded pub/sub on a cluster, raw: N subscribers (`redis-cli`), one message
    per event from a script; the cluster's CPU and its bus messages per event."""
    import redis

    with tempfile.TemporaryDirectory() as tmp, redis_servers(Path(tmp), cluster=True) as servers:
        ports, pids = [p for p, _ in servers], [pid for _, pid in servers]
        client = redis.RedisCluster(host="127.0.0.1", port=ports[0])
        # One account on each master, so that sharded channels spread over the shards.
        names, masters = [], set()
        for i in range(10_000):
            owner = client.get_node_from_key(  # type: ignore[no-untyped-call]
                f"fan:account:{{a{i}}}"
            ).port
            if owner not in masters:
                masters.add(owner)
                names.append((f"a{i}", owner))
            if len(masters) == 3:
                break
        print("| N | kind | Redis CPU µs/event (all nodes) | cluster bus messages/event |")
        print("|---|---|---|---|")
        for n in (2, 8):
            for kind, script in PUBLISHER.items():
                subscribers = []
                for _ in range(n):
                    if kind == "PUBLISH":
                        cmds = [[str(ports[-1]), "subscribe", "fan:events"]]
                    else:
                        cmds = [[str(p), "ssubscribe", f"fan:events:{{{a}}}"] for a, p in names]
                    for port, *rest in cmds:
                        subscribers.append(subprocess.Popen(
                            ["redis-cli", "-p", port, *rest], stdout=subprocess.DEVNULL
                        ))  # fmt: skip
                time.sleep(1.0)  # subscribed
                sha = client.script_load(script)
                idle = idle_cpu_per_sec(pids)
                bus, cpu = bus_messages(ports), sum(cpu_secs(pid) for pid in pids)
                start, sent = time.monotonic(), 0
                while (elapsed := time.monotonic() - start) < args.secs:
                    while sent < elapsed * args.rate:
                        name = names[sent % len(names)][0]
                        keys = [f"fan:account:{{{name}}}", f"fan:events:{{{name}}}"]
                        client.evalsha(sha, 2, *keys, "fan:events", "x" * 40)
                        sent += 1
                    time.sleep(0.005)
                time.sleep(0.5)
                cpu = sum(cpu_secs(pid) for pid in pids) - cpu - idle * (time.monotonic() - start)
                bus = bus_messages(ports) - bus
                print(f"| {n} | {kind} | {cpu / sent * 1e6:.1f} | {bus / sent:.1f} |", flush=True)
                for proc in subscribers:
                    proc.kill()
                    proc.wait()
        client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["standalone", "cluster"], default="standalone")
    parser.add_argument("--accounts", type=int, default=8)
    parser.add_argument("--rate", type=int, default=1000, help="events a second")
    parser.add_argument("--secs", type=float, default=3.0)
    parser.add_argument("--min", type=int, default=2)
    parser.add_argument("--max", type=int, default=8)
    parser.add_argument("--sharded-compare", action="store_true")
    args = parser.parse_args()
    if shutil.which("redis-server") is None:
        raise SystemExit("needs redis-server (Debian: apt install redis-server)")
    if args.sharded_compare:
        sharded_compare(args)
    else:
        fanout(args)


if __name__ == "__main__":
    main()
