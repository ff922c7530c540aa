"""CPU time per request by function, sampled by `perf`: where a CPU-time target's time goes.

    python bench/cpu_profile.py                   # the example gateway against its floor, 1 KB
    python bench/cpu_profile.py --pair processor  # the processor behind Envoy, 128 KB vs 1 KB
    python bench/cpu_profile.py --secs 3 --top 15 # shorter runs, fewer rows

The targets of the gateway's ratio to its floor and of the processor's growth with the body
are in CPU time, and `bench/instructions.py` counts instructions, which weigh an interpreter's
dispatch, a cache miss and a SIMD copy alike. This samples each process with `perf record -e
cpu-clock` (the kernel's software clock: a virtual machine without hardware counters has it)
while wrk drives it as `bench/run.py` does (16 connections, the server pinned to core 0), and
gives each C function's CPU per request: the samples that fell in it over the requests served
meanwhile. Python functions show as the interpreter (`_PyEval_EvalFrameDefault`); C functions
under it (msgspec's decode, the UTF-8 check, allocation, the collector) by name, the kernel's
too when perf may see them (as root).

gateway: the aiohttp pass-through (section 3's floor) and the example gateway as shipped, each
in front of the mock upstream, sent the same OpenAI conversation of `--size`.
processor: `switchyard-mw extproc` (its default transport) behind Envoy with the example
config, sent an Anthropic conversation of 1 KB, then one of `--size` (128 KB unless given).

Each pair's rows are sorted by what the second adds over the first. Samples are counted, not
timed: a figure moves with the machine's load as any CPU time does, less than a ratio of two
runs does (both sides of a row are sampled under the same conditions, one after the other).
Needs perf (Debian's linux-perf), wrk and, for the processor, Envoy.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (
    BENCH,
    OPENAI_PATH,
    PYTHON,
    SIZES,
    Processes,
    anthropic_body,
    commit_measured,
    free_port,
    have,
    lua_script,
    mock_upstream,
    openai_body,
    uvicorn_cmd,
    wrk,
)

HZ = 2999  # samples a second of CPU: odd, so as not to beat with a timer of the loop's
CONNS = 16
_LINE = re.compile(r"^\s*[\d.]+%\s+(\d+)\s+\[(.)\]\s+(\S+)")
KERNEL = "(kernel) "


@dataclass(frozen=True)
class Profile:
    """One process's samples by function over `requests` requests."""

    label: str
    requests: int
    samples: dict[str, int]

    def us_per_request(self, name: str) -> float:
        return self.samples.get(name, 0) * 1e6 / HZ / self.requests

    @property
    def total_ms(self) -> float:
        return sum(self.samples.values()) * 1e3 / HZ / self.requests


@dataclass(frozen=True)
class Row:
    function: str
    first_us: float
    second_us: float

    @property
    def added_us(self) -> float:
        return self.second_us - self.first_us


# What a function's time is spent on, by its name (first match wins; the rest is "other").
GROUPS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("kernel", re.compile(r"^\(kernel\) ")),
    ("collector", re.compile(r"^(gc_collect|visit_|move_|update_refs|subtract_refs|.*_traverse$)")),
    ("UTF-8 check", re.compile(r"^unicode_decode_utf8$")),
    ("msgspec", re.compile(r"^(json_|Struct_|mpack_|ms_)")),
    ("copies", re.compile(r"^__(memmove|memcpy|memset)")),
    ("allocation", re.compile(r"(?i)(malloc|free|alloc|dealloc|_int_)")),
    ("interpreter", re.compile(r"^(_PyEval_|initialize_locals|_PyFrame_)")),
)


def group_of(name: str) -> str:
    return next((group for group, pattern in GROUPS if pattern.search(name)), "other")


def samples_by_function(report: str) -> dict[str, int]:
    """`perf report --stdio --sort symbol -n`'s lines as samples by function; the kernel's
    marked as such (perf marks them `[k]`)."""
    found: dict[str, int] = {}
    for line in report.splitlines():
        match = _LINE.match(line)
        if match is None:
            continue
        samples, where, name = int(match[1]), match[2], match[3]
        name = KERNEL + name if where == "k" else name
        found[name] = found.get(name, 0) + samples
    return found


def difference(first: Profile, second: Profile, top: int) -> list[Row]:
    """The `top` functions by what `second` spends on them per request over `first`."""
    names = set(first.samples) | set(second.samples)
    rows = [Row(n, first.us_per_request(n), second.us_per_request(n)) for n in names]
    rows.sort(key=lambda r: (-r.added_us, r.function))
    return rows[:top]


def by_group(first: Profile, second: Profile) -> list[Row]:
    """Both profiles summed by `GROUPS`, in their order, "other" last."""
    totals = {group: [0.0, 0.0] for group, _ in GROUPS} | {"other": [0.0, 0.0]}
    for i, profile in enumerate((first, second)):
        for name in profile.samples:
            totals[group_of(name)][i] += profile.us_per_request(name)
    return [Row(group, a, b) for group, (a, b) in totals.items()]


def table(first: Profile, second: Profile, rows: Sequence[Row], *, what: str = "function") -> str:
    head = (
        f"CPU per request: {first.label} {first.total_ms:.3f} ms ({first.requests} requests "
        f"sampled), {second.label} {second.total_ms:.3f} ms ({second.requests}); "
        f"added {second.total_ms - first.total_ms:+.3f} ms"
    )
    lines = [
        head,
        "",
        f"| {what} | {first.label}, µs | {second.label}, µs | added, µs |",
        "|---|---:|---:|---:|",
    ]
    quote = "`" if what == "function" else ""
    lines += [
        f"| {quote}{r.function}{quote} | {r.first_us:.1f} | {r.second_us:.1f} | {r.added_us:+.1f} |"
        for r in rows
    ]
    return "\n".join(lines)


def sampled(label: str, pid: int, url: str, body: bytes, *, secs: float, workdir: Path) -> Profile:
    """`pid` sampled while wrk sends `body` to `url` for `secs` (after as long a warm-up)."""
    script = lua_script(workdir, body)
    wrk(url, script, conns=CONNS, secs=max(1.0, secs / 2))
    data = workdir / f"perf-{label.replace(' ', '-')}.data"
    cmd = ["perf", "record", "-q", "-e", "cpu-clock", "-F", str(HZ), "-o", str(data)]
    recorder = subprocess.Popen([*cmd, "-p", str(pid)], stderr=subprocess.PIPE)
    try:
        time.sleep(0.3)  # perf attached before the first request
        load = wrk(url, script, conns=CONNS, secs=secs)
    finally:
        recorder.send_signal(2)  # perf writes its file on SIGINT
        _, err = recorder.communicate(timeout=60)
    if recorder.returncode not in (0, -2) or not data.exists():
        raise RuntimeError(f"perf record failed ({recorder.returncode}): {err.decode()[-500:]}")
    report = subprocess.run(
        ["perf", "report", "-i", str(data), "--stdio", "--sort", "symbol", "-n"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return Profile(label, load.requests, samples_by_function(report))


def gateway_pair(procs: Processes, size: str, secs: float) -> tuple[Profile, Profile]:
    import _peers

    body = openai_body(_peers.MODEL, SIZES[size])
    with mock_upstream(procs) as mock:
        env = _peers.environment(procs.workdir, mock)
        servers = [
            (_peers.FLOOR, {"BENCH_CLIENT": "aiohttp"}, "_apps:passthrough_app"),
            ("example gateway", {"BENCH_CLIENT": "default"}, "_apps:gateway_app"),
        ]
        profiles = []
        for label, extra, target in servers:
            with _serving(procs, target, {**env, **extra}) as (url, pid):
                profiles.append(sampled(label, pid, url, body, secs=secs, workdir=procs.workdir))
    return profiles[0], profiles[1]


@contextlib.contextmanager
def _serving(procs: Processes, target: str, env: Mapping[str, str]) -> Iterator[tuple[str, int]]:
    port = free_port()
    proc = procs.start(target.split(":")[1], uvicorn_cmd(target, port), port=port, env=env)
    try:
        yield f"http://127.0.0.1:{port}{OPENAI_PATH}", proc.pid
    finally:
        procs.stop(proc)


def processor_pair(procs: Processes, size: str, secs: float) -> tuple[Profile, Profile]:
    from _envoy import behind_envoy, processor_config

    with mock_upstream(procs) as mock:
        config = processor_config(procs.workdir, mock)
        cmd = [PYTHON, "-m", "switchyard_mw.cli", "extproc", "--config", str(config)]
        upstream_port = int(mock.rsplit(":", 1)[1])
        with behind_envoy(procs, upstream_port, cmd) as (url, pid):
            small, large = (anthropic_body("claude-opus-5", SIZES[s]) for s in ("1KB", size))
            first = sampled("1KB", pid, url, small, secs=secs, workdir=procs.workdir)
            second = sampled(size, pid, url, large, secs=secs, workdir=procs.workdir)
    return first, second


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", choices=("gateway", "processor"), default="gateway")
    parser.add_argument("--size", default=None, help="body size (gateway 1KB, processor 128KB)")
    parser.add_argument("--secs", type=float, default=6.0, help="seconds sampled per side")
    parser.add_argument("--top", type=int, default=25, help="rows shown")
    parser.add_argument("--out", type=Path, default=BENCH / "out", help="results directory")
    args = parser.parse_args(argv)
    size = args.size or ("1KB" if args.pair == "gateway" else "128KB")
    if size not in SIZES:
        parser.error(f"--size: one of {sorted(SIZES)}")
    missing = [tool for tool in ("perf", "wrk") if not have(tool)]
    if missing:
        print(f"missing: {', '.join(missing)} (Debian: linux-perf, wrk)", file=sys.stderr)
        return 2
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    workdir = out / "cpu_profile"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir()
    procs = Processes(workdir)
    try:
        pair = gateway_pair if args.pair == "gateway" else processor_pair
        first, second = pair(procs, size, args.secs)
    finally:
        procs.close()
    text = table(first, second, by_group(first, second), what="spent on")
    text += "\n\n" + table(first, second, difference(first, second, args.top)).split("\n\n")[1]
    print(text)
    meta = {"commit": commit_measured(), "date": time.strftime("%Y-%m-%d %H:%M"), "size": size}
    payload = {"meta": meta, "pair": args.pair, "profiles": [asdict(first), asdict(second)]}
    (out / f"cpu_profile-{args.pair}.json").write_text(json.dumps(payload, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
