"""Instructions per request, counted by valgrind: the bench's figure that noise does not move.

Wall-clock figures on a shared machine move by a fifth between runs, more than most changes
being judged; the number of instructions a request executes does not. Each figure is
(instructions of a run with N requests - those of the same run with none) / N, counted by
`valgrind --tool=callgrind` over the whole process, so start-up and imports cancel out.

    python bench/instructions.py                  # both modes
    python bench/instructions.py --mode inproc    # section 1's apps, driven in process
    python bench/instructions.py --mode served    # bare, minimal and stacked app under uvicorn
    python bench/instructions.py --smoke          # two apps in process, few requests (a test)
    python bench/instructions.py --sizes 1KB,1MB  # at these body sizes (default 1KB)
    python bench/instructions.py --mode served --requests 30 --no-peers   # served, quickly
    python bench/instructions.py --mode processor # the ext_proc processor under Envoy (h2)
    BENCH_CALLGRIND_DIR=/tmp/cg python bench/instructions.py ...  # keep each run's profile

in process: every app of section 1, on one body, through section 1's own driver.
served: the bare app, the minimal middleware and `switchyard_stack` under one uvicorn worker
(httptools, as section 2), then section 3's aiohttp pass-through (the floor), the
necessary-work floor (the same plus one `wire.read_request`, the body sent as the gateway
sends it) and the example gateway in front of its mock upstream (an Envoy, not counted); each
sent exactly N requests over 8 keep-alive connections by a client outside valgrind; every
answer must be a 200. With both floors, also `read_request` alone, N times on the same body
in a process of its own: what the necessary-work floor adds, were it only the read.
Counts are of instructions, not time: a cache miss or a system call costs far more time than
its instructions say, so the served bare app's share of time is larger than its share here.
processor: the ext_proc processor (`switchyard-mw extproc`, each transport of `--transports`)
behind a real Envoy, requests of each `--sizes` sent by h2load; only the processor runs under
valgrind (`bench/_processor.py`). Not part of `both`.
At each body size (`--sizes`) the requests carry a conversation of that size, and fewer of
them are sent as the size grows (the bytes of 1,500 1 KB requests, at least 30 requests).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (
    ANTHROPIC_PATH,
    BENCH,
    OPENAI_PATH,
    PYTHON,
    ROOT,
    SIZES,
    Processes,
    anthropic_body,
    commit_measured,
    envoy_binary,
    free_port,
    have,
    mock_upstream,
    openai_body,
    pick_sizes,
    uvicorn_cmd,
)

# (name, uvicorn target, extra environment): section 2's apps, answering at once ...
SERVED: tuple[tuple[str, str, dict[str, str]], ...] = (
    ("bare app", "_apps:bare", {}),
    ("minimal middleware (reference)", "_apps:minimal_app", {}),
    ("switchyard_stack", "_apps:stacked_app", {}),
)
# ... and section 3's floors and example gateway, in front of the mock upstream.
FLOOR = "pass-through aiohttp"
NECESSARY = "necessary-work floor"
READ_ALONE = "read_request alone (in process)"
PEERS: tuple[tuple[str, str, dict[str, str]], ...] = (
    (FLOOR, "_apps:passthrough_app", {"BENCH_CLIENT": "aiohttp"}),
    (NECESSARY, "_apps:passthrough_app", {"BENCH_CLIENT": "aiohttp-read"}),
    ("example gateway, shipped", "_apps:gateway_app", {"BENCH_CLIENT": "default"}),
)
_COLLECTED = re.compile(rb"Collected : (\d+)")
_CONNECTIONS = 8
_WARMUP = 40
_start_secs = 300.0
"""How long a served app under valgrind may take to start (`--start-secs`)."""


def _valgrind(cmd: Sequence[str], label: str) -> list[str]:
    """`cmd` under callgrind; BENCH_CALLGRIND_DIR keeps the profile there as `callgrind.<label>`
    (for callgrind_annotate), as `_processor` does."""
    keep = os.environ.get("BENCH_CALLGRIND_DIR")
    profile = f"{keep}/callgrind.{label}" if keep else "/dev/null"
    return ["valgrind", "--tool=callgrind", f"--callgrind-out-file={profile}", *cmd]


def _same_bytecode(cmd: Sequence[str], prefix: Path) -> dict[str, str]:
    """The environment for counted runs of `cmd` that all load the same bytecode: one run of
    it outside valgrind first writes every module's bytecode under `prefix`
    (PYTHONPYCACHEPREFIX), and the counted runs read it there and write none. Two counted
    runs that differ only in their number of requests could otherwise differ by millions of
    instructions in start-up, one compiling modules from source that the other found compiled
    (whatever else writes `__pycache__` meanwhile), and each run's string hashes differ unless
    seeded alike: a difference of two runs divided by the requests would come out as noise,
    even negative."""
    env = {**os.environ, "PYTHONPYCACHEPREFIX": str(prefix), "PYTHONHASHSEED": "0"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, check=True)
    return {**env, "PYTHONDONTWRITEBYTECODE": "1"}


def _collected(output: bytes) -> int:
    found = _COLLECTED.findall(output)
    if not found:
        raise RuntimeError(f"no instruction count in valgrind's output: {output[-2000:]!r}")
    return int(found[-1])


# --- in process ---------------------------------------------------------------------------------


def requests_at(size: str, n_1kb: int) -> int:
    """How many requests to count at `size`: about the bytes of `n_1kb` 1 KB ones."""
    return max(30, n_1kb * SIZES["1KB"] // SIZES[size])


def _child_inproc(name: str, label: str, size: str, n: int) -> None:
    """Runs under valgrind: build section 1's apps, warm `name` up, then serve `n` requests."""
    import _inproc

    with tempfile.TemporaryDirectory() as workdir:
        apps = _inproc.build_apps(_inproc.write_config(Path(workdir)))
    path, body = {lbl: (p, b) for lbl, p, b in _inproc.bodies(size)}[label]
    make = _inproc._driver(path, body)

    async def main() -> None:
        await _inproc._check(apps[name], name, path, body)
        await _inproc._round(apps[name], make, requests_at(size, 300) // 3)
        if n:
            await _inproc._round(apps[name], make, n)

    asyncio.run(main())


def _inproc_count(name: str, label: str, size: str, n: int, env: dict[str, str]) -> int:
    cmd = [PYTHON, __file__, "--child-inproc", name, label, size, str(n)]
    kept = f"inproc-{name}-{label}-{size}-{n}".replace(" ", "_").replace("/", "_")
    done = subprocess.run(_valgrind(cmd, kept), cwd=ROOT, env=env, capture_output=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{name} [{label}] failed: {done.stderr[-2000:]!r}")
    return _collected(done.stderr)


def inproc(names: Sequence[str], label: str, size: str, n: int, jobs: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as prefix:
        envs = {
            name: _same_bytecode(
                [PYTHON, __file__, "--child-inproc", name, label, size, "0"], Path(prefix)
            )
            for name in names
        }
        with _pool(jobs) as pool:
            runs = {
                (name, k): pool.submit(_inproc_count, name, label, size, k, envs[name])
                for name in names
                for k in (0, n)
            }
            return {name: (runs[name, n].result() - runs[name, 0].result()) / n for name in names}


def _child_read(size: str, n: int) -> None:
    """Runs under valgrind: `wire.read_request` on section 3's body of `size`, once, then `n`
    times: what the necessary-work floor adds over the floor, were it only the read."""
    import _peers

    from switchyard_mw.wire import WIRE_PATHS, read_request

    body = openai_body(_peers.MODEL, SIZES[size])
    wire = WIRE_PATHS[OPENAI_PATH]
    for _ in range(n + 1):
        read_request(wire, body)


def read_alone(size: str, n: int, jobs: int) -> float:
    """Instructions of one `wire.read_request` on section 3's body of `size`, in process."""

    def count(k: int, env: dict[str, str]) -> int:
        cmd = [PYTHON, __file__, "--child-read", size, str(k)]
        done = subprocess.run(
            _valgrind(cmd, f"read-{size}-{k}"), cwd=ROOT, env=env, capture_output=True, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"read_request alone failed: {done.stderr[-2000:]!r}")
        return _collected(done.stderr)

    with tempfile.TemporaryDirectory() as prefix:
        env = _same_bytecode([PYTHON, __file__, "--child-read", size, "0"], Path(prefix))
        with _pool(jobs) as pool:
            runs = {k: pool.submit(count, k, env) for k in (0, n)}
            return (runs[n].result() - runs[0].result()) / n


@contextlib.contextmanager
def _pool(jobs: int) -> Iterator[ThreadPoolExecutor]:
    """A pool that, on Ctrl-C (or any error), starts none of the counts still waiting: those
    running stop with their servers, which the same Ctrl-C reaches (one process group)."""
    pool = ThreadPoolExecutor(jobs)
    try:
        yield pool
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


# --- served -------------------------------------------------------------------------------------


async def _post(port: int, path: str, body: bytes, n: int) -> None:
    """Exactly `n` requests over `_CONNECTIONS` keep-alive connections; each must get a 200."""
    head = f"POST {path} HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
    request = (head + f"content-length: {len(body)}\r\n\r\n").encode() + body

    async def one_connection(count: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for _ in range(count):
                writer.write(request)
                status = (await reader.readline()).split()[1]
                length = 0
                while (line := await reader.readline()) not in (b"\r\n", b""):
                    name, _, value = line.partition(b":")
                    if name.lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                if status != b"200":
                    raise RuntimeError(f"the server answered {status.decode()}")
        finally:
            writer.close()

    share, rest = divmod(n, _CONNECTIONS)
    await asyncio.gather(*(one_connection(share + (i < rest)) for i in range(_CONNECTIONS)))


def _served_count(
    target: str, env: dict[str, str], path: str, body: bytes, n: int, workdir: Path
) -> int:
    port = free_port()
    run = f"served-{target.split(':')[1]}-{env.get('BENCH_CLIENT', '')}-{len(body)}-{n}"
    log = workdir / f"{run}-{port}.log"
    warmup = max(8, _WARMUP * SIZES["1KB"] // len(body))
    cmd = _valgrind(uvicorn_cmd(target, port, pin=False), run)
    with log.open("wb") as out:
        server = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}, stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + _start_secs  # imports under valgrind take a while
        while True:
            try:
                asyncio.run(_post(port, path, body, warmup))
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    text = log.read_bytes()[-2000:]
                    raise RuntimeError(f"{target} did not start: {text!r}") from None
                time.sleep(0.5)
        if n:
            asyncio.run(_post(port, path, body, n))
    finally:
        server.send_signal(signal.SIGINT)  # uvicorn's clean exit: valgrind then reports
        server.wait(120)
    return _collected(log.read_bytes())


def served(
    n: int,
    jobs: int,
    workdir: Path,
    size: str = "1KB",
    *,
    with_peers: bool = True,
    names: Sequence[str] | None = None,
) -> tuple[dict[str, float], dict[str, float]]:
    """Section 2's apps, then (`with_peers`) section 3's floors and gateway (when an Envoy can
    be the mock); of each, those `names` holds (None: every one)."""
    import _inproc
    import _peers

    env = {**_inproc.ENV, "BENCH_CONFIG": str(_inproc.write_config(workdir))}
    wanted = [app for app in SERVED if names is None or _named(app[0], names)]
    floors = [app for app in PEERS if with_peers and (names is None or _named(app[0], names))]
    if not wanted and not floors:
        known = [a[0] for a in (*SERVED, *PEERS)]
        raise SystemExit(f"--apps names none of the served apps {known}")
    jobs_of = [(name, target, {**env, **extra}) for name, target, extra in wanted]
    body = anthropic_body("claude-opus-5", SIZES[size])
    own = _counts(jobs_of, ANTHROPIC_PATH, body, n, jobs, workdir) if wanted else {}
    if not floors or envoy_binary() is None:
        return own, {}
    procs = Processes(workdir)
    try:
        with mock_upstream(procs) as mock:
            env = _peers.environment(workdir, mock)
            jobs_of = [(name, target, {**env, **extra}) for name, target, extra in floors]
            body = openai_body(_peers.MODEL, SIZES[size])
            peers = _counts(jobs_of, OPENAI_PATH, body, n, jobs, workdir)
    finally:
        procs.close()
    return own, peers


def app_names(text: str) -> list[str]:
    """`--apps` as a list: split at its commas."""
    return [name.strip() for name in text.split(",") if name.strip()]


def _named(name: str, names: Sequence[str]) -> bool:
    """Whether `names` (`--apps` split at its commas) names `name`, whose own commas split it
    too ("example gateway, shipped" is two items in a row)."""
    parts = [part.strip() for part in name.split(",")]
    return any(list(names[i : i + len(parts)]) == parts for i in range(len(names)))


def _counts(
    apps: Sequence[tuple[str, str, dict[str, str]]],
    path: str,
    body: bytes,
    n: int,
    jobs: int,
    workdir: Path,
) -> dict[str, float]:
    with _pool(jobs) as pool:
        runs = {
            (name, k): pool.submit(_served_count, target, env, path, body, k, workdir)
            for name, target, env in apps
            for k in (0, n)
        }
        return {name: (runs[name, n].result() - runs[name, 0].result()) / n for name, _, _ in apps}


# --- the ext_proc processor ----------------------------------------------------------------------


def processor(
    transports: Sequence[str], n: int, jobs: int, workdir: Path, size: int = 1024
) -> dict[str, float]:
    """Instructions per request of `size` bytes of the processor on each transport, under
    Envoy."""
    import _processor

    with _pool(jobs) as pool:
        runs = {
            (t, k): pool.submit(_processor.count, t, k, workdir, size)
            for t in transports
            for k in (0, n)
        }
        return {
            f"processor ({t})": (runs[t, n].result() - runs[t, 0].result()) / n for t in transports
        }


# --- report -------------------------------------------------------------------------------------


def table(title: str, counts: dict[str, float], floor: str = "bare app") -> str:
    base = counts.get(floor)
    lines = [f"**{title}**\n", f"| app | instructions/request | added over the {floor} |"]
    lines.append("|---|---:|---:|")
    for name, count in counts.items():
        added = "" if base is None or name == floor else f"{(count - base) / 1000:+,.1f}k"
        lines.append(f"| {name} | {count / 1000:,.1f}k | {added} |")
    return "\n".join(lines)


def scaling(report: dict[str, dict[str, float]], sizes: Sequence[str]) -> str:
    """Instructions switchyard adds over each floor, one column per body size."""
    pairs = (
        ("in process", "switchyard_stack", "bare app"),
        ("served", "switchyard_stack", "bare app"),
        ("peers", NECESSARY, FLOOR),
        ("peers", "example gateway, shipped", FLOOR),
        ("peers", "example gateway, shipped", NECESSARY),
    )
    head = " | ".join(sizes)
    lines = [f"| added instructions/request | {head} |", "|---|" + "---:|" * len(sizes)]
    reads = [report.get(f"read alone {size}", {}).get(READ_ALONE) for size in sizes]
    if any(r is not None for r in reads):
        read_cells = " | ".join("-" if r is None else f"{r / 1000:,.1f}k" for r in reads)
        lines.append(f"| {READ_ALONE} | {read_cells} |")
    for kind, name, floor in pairs:
        cells = []
        for size in sizes:
            counts = report.get(f"{kind} {size}", {})
            if name in counts and floor in counts:
                cells.append(f"{(counts[name] - counts[floor]) / 1000:,.1f}k")
            else:
                cells.append("-")
        if any(c != "-" for c in cells):
            lines.append(f"| {name} - {floor} ({kind}) | {' | '.join(cells)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--mode", choices=("both", "inproc", "served", "processor"), default="both")
    parser.add_argument("--smoke", action="store_true", help="two apps in process, 100 requests")
    parser.add_argument("--body", default="anthropic+canary", help="section 1's body label")
    parser.add_argument("--sizes", default="1KB", help=f"comma-separated, of {list(SIZES)}")
    parser.add_argument(
        "--apps",
        default=None,
        help="comma-separated apps (default: every one): section 1's in process, and those of "
        "them section 2 serves; served, also section 3's",
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=None,
        help="requests counted per app at 1 KB (default 1500 in process, 1600 served)",
    )
    parser.add_argument(
        "--no-peers", action="store_true", help="served: not the floor and gateway (section 3)"
    )
    parser.add_argument(
        "--transports", default="h2", help="processor: comma-separated, of h2,frames,grpcio"
    )
    parser.add_argument(
        "--start-secs",
        type=float,
        default=300.0,
        help="served: seconds a server under valgrind may take to start (more when loaded)",
    )
    parser.add_argument("--out", type=Path, default=BENCH / "out", help="results directory")
    parser.add_argument("--child-inproc", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--child-read", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    global _start_secs
    _start_secs = args.start_secs
    if args.child_inproc:
        name, label, size, n = args.child_inproc
        _child_inproc(name, label, size, int(n))
        return 0
    if args.child_read:
        _child_read(args.child_read[0], int(args.child_read[1]))
        return 0
    try:
        sizes = pick_sizes(args.sizes)
    except ValueError as exc:
        parser.error(str(exc))
    if not have("valgrind"):
        print("valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 2
    started = time.monotonic()
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    report, texts = _count_all(args, sizes, out)
    if len(sizes) > 1 and args.mode != "processor":
        texts.append("**by body size**\n\n" + scaling(report, sizes))
    text = "\n\n".join(texts)
    print(text)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "commit": commit_measured(),
        "smoke": args.smoke,
        "sizes": sizes,
    }
    payload = {"meta": meta, **report}
    (out / "instructions.json").write_text(json.dumps(payload, indent=1) + "\n")
    (out / "instructions.md").write_text(f"{text}\n\n(commit {meta['commit']}, {meta['date']})\n")
    print(f"\n({out / 'instructions.json'}; {time.monotonic() - started:.0f} s)")
    return 0


def _count_all(
    args: argparse.Namespace, sizes: Sequence[str], out: Path
) -> tuple[dict[str, dict[str, float]], list[str]]:
    """Every count asked for, by "<mode> <size>" (the 1 KB ones also by their mode alone)."""
    import _inproc

    jobs = os.cpu_count() or 1
    report: dict[str, dict[str, float]] = {}
    texts: list[str] = []
    if args.mode == "processor":
        transports = [t.strip() for t in args.transports.split(",") if t.strip()]
        for size in sizes:
            n = requests_at(size, args.requests or 600)
            counts = processor(transports, n, jobs, out / "logs", SIZES[size])
            _keep(report, "processor", size, counts)
            title = f"the ext_proc processor under Envoy [anthropic, {size}]"
            texts.append(table(title, counts, ""))
        return report, texts
    for size in sizes:
        if args.mode in ("both", "inproc") or args.smoke:
            with tempfile.TemporaryDirectory() as tmp:
                names = list(_inproc.build_apps(_inproc.write_config(Path(tmp))))
            if args.smoke:
                names = ["bare app", "switchyard_stack"]
            elif args.apps:
                names = app_names(args.apps)
            n = 100 if args.smoke else requests_at(size, args.requests or 1500)
            counts = inproc(names, args.body, size, n, jobs)
            _keep(report, "in process", size, counts)
            texts.append(table(f"in process [{args.body}, {size}]", counts))
        if args.mode in ("both", "served") and not args.smoke:
            workdir = out / "logs"
            workdir.mkdir(exist_ok=True)
            n = requests_at(size, args.requests or 1600)
            served_apps = app_names(args.apps) if args.apps else None
            own, peers = served(
                n, jobs, workdir, size, with_peers=not args.no_peers, names=served_apps
            )
            if own:
                _keep(report, "served", size, own)
                texts.append(table(f"served by uvicorn [anthropic+canary, {size}]", own))
            if peers:
                _keep(report, "peers", size, peers)
                title = f"in front of the mock upstream [openai, {size}]"
                texts.append(table(title, peers, FLOOR))
            if NECESSARY in peers and FLOOR in peers:
                read = read_alone(size, n, jobs)
                _keep(report, "read alone", size, {READ_ALONE: read})
                added = peers[NECESSARY] - peers[FLOOR]
                texts.append(
                    f"The {NECESSARY} adds {added / 1000:,.1f}k instructions a request over the "
                    f"{FLOOR}; `wire.read_request` alone on the same body, in process, "
                    f"costs {read / 1000:,.1f}k ({added / read:.2f}x)."
                )
    return report, texts


def _keep(
    report: dict[str, dict[str, float]], kind: str, size: str, counts: dict[str, float]
) -> None:
    report[f"{kind} {size}"] = counts
    if size == "1KB":
        report[kind] = counts  # where readers of the 1 KB-only report found it


if __name__ == "__main__":
    sys.exit(main())
