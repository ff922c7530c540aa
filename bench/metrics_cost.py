"""Instructions the request metrics cost per request, counted by valgrind.

`telemetry.request_metrics.observe()` runs once per request on the hot path (both fronts: the
ASGI stack and the ext_proc server). Each figure is (instructions of a process that calls it N
times - those of the same process calling a no-op of the same signature N times) / N, counted
by `valgrind --tool=callgrind`, so imports, start-up and the loop itself cancel out. Both processes
end with one collection (`add_to`, what a reader's scrape runs), so work deferred from the hot
path to the collection is counted too.

    python bench/metrics_cost.py              # 20,000 requests per case
    python bench/metrics_cost.py -n 2000      # quicker, a little less exact
    python bench/metrics_cost.py --in-stack   # also: the stack in process, observe() on and off

Cases: a JSON answer without usage, a JSON answer with usage (input and output tokens), the
same with prompt cache reads and writes, a stream with usage (time to first token as well).
Durations spread over several buckets.
Compare with `bench/instructions.py --mode inproc`: the stack's own count per request.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = ("no usage", "usage", "usage with cache", "stream with usage")
_COLLECTED = re.compile(rb"Collected : (\d+)")


def _context(case: str) -> object:
    from switchyard_mw.accounts import Account
    from switchyard_mw.config import LLMClient
    from switchyard_mw.context import RequestContext
    from switchyard_mw.wire import Wire, read_request

    body = b'{"model":"claude-opus-5","max_tokens":5,"messages":[]}'
    ctx = RequestContext(view=read_request(Wire.ANTHROPIC, body), body=body, now=1000.0)
    ctx.resolved_model = "claude-opus-5-canary"
    ctx.variant = "claude-opus-5-canary"
    spec = LLMClient(base_url="http://a.test", models=["*"])
    ctx.account = Account(name="acct-a", spec=spec)
    ctx.response_status = 200
    if case == "usage with cache":
        ctx.report_usage(
            input_tokens=300, output_tokens=40, cache_read_tokens=256, cache_write_tokens=30
        )
    elif case != "no usage":
        ctx.report_usage(input_tokens=300, output_tokens=40)
    if case == "stream with usage":
        ctx.first_token_at = 1000.2
    return ctx


def _child(case: str, n: int, noop: bool) -> None:
    """Runs under valgrind: `n` finished requests of `case`, then one collection."""
    from switchyard_mw.telemetry import request_metrics as rm

    ctx = _context(case)
    ends = [1000.0 + 0.004 + (i % 97) * 0.013 for i in range(n)]  # 4 ms .. 1.25 s

    def nothing(ctx: object, end: float, error: str | None = None) -> None:
        return None

    observe = nothing if noop else rm.observe
    for end in ends:
        observe(ctx, end)  # type: ignore[arg-type]
    rm.add_to(None)


def _child_stack(n: int, noop: bool) -> None:
    """Runs under valgrind: `bench/instructions.py`'s in-process stack run, observe() on or off."""
    sys.path.insert(0, str(ROOT / "bench"))
    import instructions

    from switchyard_mw.telemetry import request_metrics as rm

    if noop:  # both fronts call it through the module: this turns the request metrics off
        rm.observe = lambda ctx, end, error=None: None
    instructions._child_inproc("switchyard_stack", "anthropic+canary", "1KB", n)


def _count(case: str, n: int, noop: bool) -> int:
    cmd = [sys.executable, __file__, "--child", case, str(n), "noop" if noop else "observe"]
    valgrind = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"]
    env = {**os.environ, "PYTHONHASHSEED": "0"}  # the same imports in every run: no noise
    done = subprocess.run([*valgrind, *cmd], cwd=ROOT, env=env, capture_output=True, check=False)
    found = _COLLECTED.findall(done.stderr)
    if done.returncode != 0 or not found:
        raise RuntimeError(f"{case}: {done.stderr[-2000:]!r}")
    return int(found[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("-n", type=int, default=20_000, help="requests per case")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--in-stack", action="store_true", help="the stack with and without")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        case, n, kind = args.child
        if case == "stack":
            _child_stack(int(n), kind == "noop")
        else:
            _child(case, int(n), kind == "noop")
        return 0
    with ThreadPoolExecutor(args.jobs) as pool:
        base = pool.submit(_count, CASES[0], args.n, True)
        runs = {case: pool.submit(_count, case, args.n, False) for case in CASES}
        print("| case | instructions/request added by observe() |")
        print("|---|---:|")
        for case, run in runs.items():
            added = (run.result() - base.result()) / args.n
            print(f"| {case} | {added / 1000:,.2f}k |")
        if args.in_stack:
            print(in_stack(pool, 1500))
    return 0


def in_stack(pool: ThreadPoolExecutor, n: int) -> str:
    """`switchyard_stack` in process (as `bench/instructions.py`), observe() on and off."""
    runs = {(k, off): pool.submit(_count, "stack", k, off) for k in (0, n) for off in (False, True)}
    on, off = ((runs[n, o].result() - runs[0, o].result()) / n for o in (False, True))
    return (
        f"\nswitchyard_stack in process [anthropic+canary]: {on / 1000:,.1f}k instructions/request"
        f" with the request metrics, {off / 1000:,.1f}k without: they add"
        f" {(on - off) / 1000:,.1f}k ({(on - off) / off:.1%})"
    )


if __name__ == "__main__":
    sys.exit(main())
