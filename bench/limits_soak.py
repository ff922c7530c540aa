"""Limits soak: two replicas (processes) spend one tenant's limit in a shared redis-server while
it restarts with its data gone; at the end, what was charged beyond the limit against the bound
the docs give, and no operation lost.

    python bench/limits_soak.py              # 2 minutes, 3 restarts
    python bench/limits_soak.py --smoke      # about 20 s, 2 restarts: the mode tests run

Each worker runs `state.redis_limits.RedisLimits` (`[state] timeout_ms = 250`,
`replicas_hint = 2`) with 32 requests in flight (64 across the two), paced to 50 requests a
second each: a request reserves its worst case (an input estimate of 100 tokens +
`max_tokens` 100), holds it a few ms, and settles what it "used": the estimate off by up to
+-10 tokens, plus 0 to 100 output tokens. The limit (a day's tokens) is about 60 % of what the
run asks for at that pace, so it runs out between the first restart and the last: Redis goes
away while the limit is being spent, and again once it is spent.

The bound on what the replicas charge beyond the limit (docs: Tenants, "When Redis is down"):
the input estimate's error of the requests admitted; for each restart that loses Redis's data
(it held K), the worst over which replica came back first (j): what its last read missed,
K - r_j, plus what the others charged on their local shares in that outage (they go up only
when each comes back, while j admits against Redis); for an outage no restart caused, each
replica's share of what it had not read (`(limit - last read) / replicas_hint`). Each
replica's local charge in an outage is held to its share apart: at most (limit - its last
read) / replicas_hint plus the estimate's error.

First, a burst: both workers unpaced, 32 requests in flight each, on a limit of 20,000 tokens,
every request writing its whole `max_tokens` with an input estimate short by up to 30 tokens:
what passes the limit is at most the shortfall of the requests in flight when it fills
(64 x 30), and of all admitted (whichever is smaller).

Targets: burst overspend <= its bound, nothing of it granted locally; charged - limit <= the
soak's bound; no local share overspent; no reserve or settle raised; no reserve waited longer
than `timeout_ms` + 500 ms (a loaded machine's event loop); each worker saw an outage and the
recovery (its requests went local, then to Redis again). Exit 0 when every target is met.
Before the soak, one client's reserve latency on loopback against the in-process store.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis
from _harness import free_port, wait_for_port

from switchyard_mw.core.limits import Granted, LimitKey, Measure
from switchyard_mw.state.limit_stores import LocalLimits
from switchyard_mw.state.redis_limits import RedisLimits, limit_key

BURST = LimitKey(scope="burst", measure=Measure.TOKENS, per="day", amount=20_000)
BURST_SECS = 3.0
UNDER = 30
"""The most a burst request's input estimate falls short by."""
RATE = 50.0
"""Requests a second per worker."""
SPENT_AT = 0.6
"""The fraction of the run's demand the limit allows."""
ESTIMATE, MAX_TOKENS, ERROR = 100, 100, 10
TIMEOUT_SECS = 0.25
MARGIN_SECS = 0.5
REPLICAS = 2
PREFIX = "soak"


# --- a worker: one replica ----------------------------------------------------------------


def limit_of(amount: float) -> LimitKey:
    return LimitKey(scope="soak", measure=Measure.TOKENS, per="day", amount=amount)


def limit_for(seconds: float) -> LimitKey:
    """SPENT_AT of what both workers ask over the run at RATE (a request uses 150 on average)."""
    return limit_of(round(SPENT_AT * REPLICAS * RATE * seconds * (ESTIMATE + MAX_TOKENS / 2)))


@dataclasses.dataclass
class Outage:
    """One outage as a worker saw it."""

    at: float
    """The wall time it began (the first request that found the store down)."""
    read: float
    """The limit's use the worker last read from Redis."""
    charged: float = 0.0
    """Tokens its requests granted on the local share charged."""
    error: float = 0.0
    """Of which the input estimate's error."""
    over: float | None = None
    """The wall time it was seen over (the first request that found Redis back)."""


async def worker(
    url: str, seconds: float, concurrency: int, seed: int, limit: LimitKey
) -> dict[str, Any]:
    store = RedisLimits(
        url,
        key_prefix=PREFIX,
        timeout_secs=TIMEOUT_SECS,
        replicas_hint=REPLICAS,
        reconnect_max_secs=0.2,
    )
    rng = random.Random(seed)
    tally: dict[str, Any] = dict.fromkeys(
        ("granted", "refused", "local", "charged", "error", "raised", "slow"), 0
    )
    latencies: list[float] = []
    phases: list[str] = []  # "shared" / "local", as the worker saw the store change
    outages: list[Outage] = []
    last_read = 0.0
    end = time.monotonic() + seconds

    def watch() -> None:
        nonlocal last_read
        phase = "shared" if store.healthy else "local"
        if phase == "shared":
            last_read = store.used(limit)
        if not phases or phases[-1] != phase:
            phases.append(phase)
            if phase == "local":
                outages.append(Outage(at=time.time(), read=last_read))
            elif outages:
                outages[-1].over = time.time()

    async def one() -> None:
        while time.monotonic() < end:
            await asyncio.sleep(rng.expovariate(RATE / concurrency))
            watch()
            began = time.perf_counter()
            try:
                outcome = await store.reserve({limit: ESTIMATE + MAX_TOKENS})
            except Exception:
                tally["raised"] += 1
                continue
            waited = time.perf_counter() - began
            latencies.append(waited)
            tally["slow"] += waited > TIMEOUT_SECS + MARGIN_SECS
            watch()
            if not isinstance(outcome, Granted):
                tally["refused"] += 1
                continue
            tally["granted"] += 1
            # Made on the share, as the store holds it: Redis may have been found gone (by
            # another request) after this one was granted there.
            on_share = store.on_share(outcome.reservation)
            local = outages[-1] if on_share and outages else None
            tally["local"] += on_share
            await asyncio.sleep(rng.uniform(0.001, 0.01))
            used = ESTIMATE + rng.randint(-ERROR, ERROR) + rng.randint(0, MAX_TOKENS)
            tally["charged"] += used
            tally["error"] += max(0, used - (ESTIMATE + MAX_TOKENS))
            if local is not None:
                local.charged += used
                local.error += max(0, used - (ESTIMATE + MAX_TOKENS))
            try:
                await store.settle(outcome.reservation, {Measure.TOKENS: used})
            except Exception:
                tally["raised"] += 1

    await asyncio.gather(*(one() for _ in range(concurrency)))
    await store.aclose()
    tally["dropped_settles"] = store.dropped_settles
    tally["phases"] = phases
    tally["outages"] = [dataclasses.asdict(outage) for outage in outages]
    tally["max_wait_ms"] = round(max(latencies, default=0) * 1000, 1)
    return tally


async def burst(url: str, concurrency: int, seed: int) -> dict[str, Any]:
    """Unpaced: `concurrency` requests in flight until BURST_SECS are over, on BURST; each
    writes its whole `max_tokens` (the worst case is what it uses) and its input estimate is
    short by up to UNDER tokens (or over by 10)."""
    # A long timeout: what is measured here is Redis under concurrency, not an outage.
    store = RedisLimits(url, key_prefix=PREFIX, timeout_secs=5.0, replicas_hint=REPLICAS)
    rng = random.Random(seed)
    tally = {"granted": 0, "charged": 0, "error": 0, "local": 0}
    end = time.monotonic() + BURST_SECS

    async def one() -> None:
        while time.monotonic() < end:
            outcome = await store.reserve({BURST: ESTIMATE + MAX_TOKENS})
            if not isinstance(outcome, Granted):
                await asyncio.sleep(0.001)
                continue
            tally["granted"] += 1
            tally["local"] += not store.healthy
            await asyncio.sleep(rng.uniform(0.001, 0.01))
            used = ESTIMATE + rng.randint(-10, UNDER) + MAX_TOKENS
            tally["charged"] += used
            tally["error"] += max(0, used - (ESTIMATE + MAX_TOKENS))
            await store.settle(outcome.reservation, {Measure.TOKENS: used})

    await asyncio.gather(*(one() for _ in range(concurrency)))
    await store.aclose()
    return tally


# --- the parent: redis, the restarts, the verdict ------------------------------------------


class Redis:
    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        log_path = self.workdir / "redis.log"
        command = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1"]
        command += ["--save", "", "--appendonly", "no", "--dir", str(self.workdir)]
        with log_path.open("ab") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        wait_for_port(self.port, self.proc, 10, log_path)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def freeze(self, limit: LimitKey) -> float:
        """Stop every write (a script that writes waits), then read what the limit holds: what
        Redis holds when it goes, exactly."""
        client = redis.Redis.from_url(self.url, socket_timeout=1, decode_responses=True)
        try:
            client.client_pause(10_000, all=False)  # WRITE: reads still answer
            value: str | None = client.hget(limit_key(PREFIX, limit), "n")  # type: ignore[assignment]
            return float(value) if value is not None else 0.0
        finally:
            client.close()


async def reserve_latency(url: str, rounds: int) -> dict[str, float]:
    """One client, one request at a time: a reserve's and a settle's median and p99 (µs),
    Redis and local."""
    out: dict[str, float] = {}
    key = LimitKey(scope="latency", measure=Measure.TOKENS, per="day", amount=1e12)
    redis_store = RedisLimits(url, key_prefix="lat", timeout_secs=1.0)
    stores: dict[str, RedisLimits | LocalLimits] = {"redis": redis_store, "local": LocalLimits()}
    for name, store in stores.items():
        reserves, settles = [], []
        for i in range(rounds + 50):
            began = time.perf_counter()
            granted = await store.reserve({key: 1})
            reserved = time.perf_counter()
            assert isinstance(granted, Granted)
            await store.settle(granted.reservation, {Measure.TOKENS: 1})
            if i >= 50:  # after warm-up: connections open, scripts loaded
                reserves.append((reserved - began) * 1e6)
                settles.append((time.perf_counter() - reserved) * 1e6)
        for step, times in (("reserve", reserves), ("settle", settles)):
            times.sort()
            out[f"{name}_{step}_p50_us"] = round(statistics.median(times), 1)
            out[f"{name}_{step}_p99_us"] = round(times[int(len(times) * 0.99) - 1], 1)
    await redis_store.aclose()
    return out


def run(seconds: float, restarts: int, concurrency: int) -> int:
    limit = limit_for(seconds)
    with tempfile.TemporaryDirectory() as tmp:
        server = Redis(Path(tmp))
        server.start()
        try:
            latency = asyncio.run(reserve_latency(server.url, 300 if seconds < 60 else 2000))
            bursts = [
                subprocess.Popen(
                    [sys.executable, __file__, "--burst", server.url, str(concurrency), str(seed)],
                    stdout=subprocess.PIPE,
                )
                for seed in range(REPLICAS)
            ]
            burst_outs = [json.loads(b.communicate(timeout=BURST_SECS + 60)[0]) for b in bursts]
            workers = [
                subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        "--worker",
                        server.url,
                        str(seconds),
                        str(concurrency),
                        str(seed),
                        str(limit.amount),
                    ],
                    stdout=subprocess.PIPE,
                )
                for seed in range(REPLICAS)
            ]
            began = time.monotonic()
            lost: list[tuple[float, float]] = []  # (wall time, what Redis held when it went)
            for k in range(1, restarts + 1):
                time.sleep(max(0.0, began + seconds * k / (restarts + 1.5) - time.monotonic()))
                at = time.time()
                lost.append((at, server.freeze(limit)))
                server.stop()
                time.sleep(1.0)
                server.start()
            outs = [json.loads(w.communicate(timeout=seconds + 60)[0]) for w in workers]
        finally:
            server.stop()
    return verdict(limit, outs, lost, latency, burst_outs, REPLICAS * concurrency)


def bound(limit: LimitKey, outs: list[dict[str, Any]], lost: list[tuple[float, float]]) -> float:
    """The overspend's bound: the estimate's error, and per restart what the replicas' last
    reads missed of what Redis held when it went (K).

    Redis comes back empty; the first replica back (j) merges its last read r_j and its local
    use, and admits against Redis from there, so it spends at most L - r_j in all, while what
    the others spent on their shares goes up only when each comes back: at most
    (K - r_j) + the others' local use. Which replica came back first is not known exactly (each
    sees it at its next request), so the bound takes the worst j: it holds whatever the order
    and the time between the two. The figure it replaces, sum (K - r_i) / 2 + (K - max r),
    holds only when the replicas come back together; it failed once on a loaded machine
    (overspend 680 against 284; which replica came back first, and when, was not recorded
    then). What the shares themselves allow is held apart (`over_shares`)."""
    allowed = float(sum(out["error"] for out in outs))
    unmatched = [sorted(out["outages"], key=lambda o: float(o["at"])) for out in outs]
    for at, held in lost:
        seen = []
        for outages in unmatched:
            # This replica's outage that the restart began: its first from then on.
            mine = next((o for o in outages if o["at"] >= at), None)
            if mine is not None:
                outages.remove(mine)
            seen.append((float(mine["read"]), float(mine["charged"])) if mine else (0.0, 0.0))
        spent = sum(charged for _, charged in seen)
        allowed += max(max(0.0, held - read) + spent - charged for read, charged in seen)
    # An outage no restart caused (a call slower than timeout_ms): Redis kept its data, and
    # held at most the limit.
    return allowed + sum(
        max(0.0, limit.amount - float(o["read"])) / REPLICAS
        for outages in unmatched
        for o in outages
    )


def over_shares(limit: LimitKey, outs: list[dict[str, Any]]) -> list[str]:
    """The outages in which a replica charged more on its local share than the share left it:
    (L - its last read) / replicas_hint, plus the estimate's error of what it granted."""
    over = []
    for k, out in enumerate(outs):
        for outage in out["outages"]:
            room = max(0.0, limit.amount - outage["read"]) / REPLICAS + outage["error"]
            if outage["charged"] > room:
                over.append(f"replica {k}: {outage['charged']:.0f} > {room:.0f}")
    return over


def verdict(
    limit: LimitKey,
    outs: list[dict[str, Any]],
    lost: list[tuple[float, float]],
    latency: dict[str, float],
    burst_outs: list[dict[str, Any]],
    in_flight: int,
) -> int:
    keys = [key for key, value in outs[0].items() if isinstance(value, int | float)]
    total = {key: sum(out[key] for out in outs) for key in keys}
    overspend = max(0, round(total["charged"] - limit.amount))
    allowed = bound(limit, outs, lost)
    recovered = all("local" in out["phases"] and out["phases"][-1] == "shared" for out in outs)
    reads = [f"{o['read']:.0f}" for out in outs for o in out["outages"]]
    spent = [f"{o['charged']:.0f}" for out in outs for o in out["outages"]]
    # Each outage's end, seconds after the first restart: which replica came back first.
    origin = lost[0][0] if lost else 0.0
    ends = [
        "-" if o["over"] is None else f"{o['over'] - origin:.3f}"
        for out in outs
        for o in out["outages"]
    ]
    beyond = over_shares(limit, outs)
    burst_charged = sum(out["charged"] for out in burst_outs)
    burst_over = max(0, round(burst_charged - BURST.amount))
    # Only requests in flight when the limit fills can pass it, each by its shortfall.
    burst_bound = min(sum(out["error"] for out in burst_outs), in_flight * UNDER)
    burst_local = sum(out["local"] for out in burst_outs)
    rows = [
        (
            f"burst: {REPLICAS} processes, {BURST_SECS:.0f} s unpaced, limit",
            f"{BURST.amount:.0f}",
            "",
        ),
        (
            "burst: charged / granted",
            f"{burst_charged} / {sum(o['granted'] for o in burst_outs)}",
            "",
        ),
        ("burst: overspend (bound: in flight x shortfall)", f"{burst_over}", f"<= {burst_bound}"),
        ("burst: granted locally", f"{burst_local}", "0"),
        ("limit (tokens/day)", f"{limit.amount:.0f}", ""),
        ("charged (tokens)", f"{total['charged']}", ""),
        ("overspend", f"{overspend}", f"<= {allowed:.0f}"),
        ("  of which estimate error (bound)", f"{total['error']}", ""),
        ("restarts: Redis held", ", ".join(f"{held:.0f}" for _, held in lost), ""),
        ("outages seen: last read", ", ".join(reads), ""),
        ("outages seen: charged on the local share", ", ".join(spent), ""),
        ("outages seen: over, s after the first restart", ", ".join(ends), ""),
        ("local shares overspent", "; ".join(beyond) or "none", "none"),
        ("requests granted / refused", f"{total['granted']} / {total['refused']}", ""),
        ("granted locally (outage)", f"{total['local']}", ""),
        ("settles dropped (Redis gone)", f"{total['dropped_settles']}", ""),
        ("operations raised", f"{total['raised']}", "0"),
        (f"reserves over {(TIMEOUT_SECS + MARGIN_SECS) * 1000:.0f} ms", f"{total['slow']}", "0"),
        ("longest reserve (ms)", f"{max(out['max_wait_ms'] for out in outs)}", ""),
        ("outage seen and recovered", "yes" if recovered else "no", "yes"),
        ("reserve on loopback, Redis p50/p99 µs", _pair(latency, "redis_reserve"), ""),
        ("settle on loopback, Redis p50/p99 µs", _pair(latency, "redis_settle"), ""),
        ("reserve in process, p50/p99 µs", _pair(latency, "local_reserve"), ""),
    ]
    print("| figure | measured | target |\n|---|---|---|")
    for name, value, target in rows:
        print(f"| {name} | {value} | {target} |")
    ok = overspend <= allowed and total["raised"] == 0 and total["slow"] == 0 and recovered
    ok = ok and burst_over <= burst_bound and burst_local == 0 and not beyond
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def _pair(latency: dict[str, float], name: str) -> str:
    return f"{latency[name + '_p50_us']} / {latency[name + '_p99_us']}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="about 20 s, two restarts")
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--concurrency", type=int, default=32, help="per worker")
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument("--burst", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.burst:
        url, concurrency, seed = args.burst
        print(json.dumps(asyncio.run(burst(url, int(concurrency), int(seed)))))
        return 0
    if args.worker:
        url, seconds, concurrency, seed, amount = args.worker
        limit = limit_of(float(amount))
        out = asyncio.run(worker(url, float(seconds), int(concurrency), int(seed), limit))
        print(json.dumps(out))
        return 0
    if args.smoke:
        return run(14.0, 2, args.concurrency)
    return run(args.seconds, 3, args.concurrency)


if __name__ == "__main__":
    sys.exit(main())
