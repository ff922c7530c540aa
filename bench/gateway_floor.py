"""The example gateway against the aiohttp pass-through floor, in process: instructions per
request, and the Python functions a request runs.

    python bench/gateway_floor.py                          # instructions, 1KB,128KB
    python bench/gateway_floor.py --sizes 1KB --requests 2000
    python bench/gateway_floor.py --calls gateway --sizes 1KB   # cProfile, by function
    BENCH_CALLGRIND_DIR=/tmp/cg python bench/gateway_floor.py ...  # keep each run's profile

The apps of section 3 (`_apps`: the bare pass-through `aiohttp`, the floor; the necessary-work
floor `aiohttp-read`; the example gateway as shipped, the whole stack around the forwarding
app), and the floor inside `switchyard_stack` on the gateway's config (`stacked`: the gateway
minus it is what the forwarding app costs beyond the floor's own endpoint), are built in one
process and driven through hand-made ASGI scope/receive/send, the body in pieces of 64 KiB
(as `bench/floor_profile.py` does, but by a client that stays), each forwarding to the
bench's mock upstream (an Envoy in another process, not counted). No server: what is counted
is the app and its outbound client. uvicorn's share, and what a request costs only under a
server (the garbage collector's work on what its request objects leave), are in a served
count (`bench/instructions.py --mode served`).

Instructions: `valgrind --tool=callgrind` over a child process that builds one app, warms it
up and serves N requests, minus the same with none, over N (as `bench/instructions.py`).
Requests go one at a time. Requests at a size: about the bytes of `--requests` 1 KB ones, at
least 60.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import logging
import os
import pstats
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import OPENAI_PATH, PYTHON, ROOT, SIZES, Processes, mock_upstream, openai_body
from _inproc import pieced_driver

from switchyard_mw.asgi._types import ASGIApp

APPS = {
    "floor": "pass-through aiohttp",
    "necessary": "necessary-work floor",
    "stacked": "the floor inside switchyard_stack",
    "gateway": "example gateway, shipped",
}
MODEL = "gpt-4o-mini"
_COLLECTED = re.compile(rb"Collected : (\d+)")


def build(app: str, workdir: Path) -> ASGIApp:
    """One of `APPS`, as `_apps` builds it for the served runs (environment from `_peers`)."""
    import _apps
    import _peers

    os.environ.update(_peers.environment(workdir, os.environ["BENCH_UPSTREAM"]))
    if app == "gateway":
        built: ASGIApp = _apps.gateway("default")
        return built
    if app == "stacked":
        from switchyard_mw.asgi.stack import switchyard_stack

        config = os.environ["SWITCHYARD_CONFIG"]
        return switchyard_stack(_apps.passthrough("aiohttp"), config=config)
    return _apps.passthrough("aiohttp" if app == "floor" else "aiohttp-read")


def requests_at(size: str, n_1kb: int) -> int:
    return max(60, n_1kb * SIZES["1KB"] // SIZES[size])


async def serve(app: ASGIApp, make: Callable[..., Any], n: int) -> None:
    for _ in range(n):
        scope, receive, send, sent = make()
        await app(scope, receive, send)
        if not sent or sent[0]["status"] != 200:
            status = sent[0]["status"] if sent else "nothing"
            raise RuntimeError(f"the app answered {status}: the count is wrong")


def _child(app_name: str, size: str, n: int, calls: bool) -> None:
    """Build `app_name`, warm it up, serve `n` requests (under valgrind, or cProfile)."""
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # sessions live as the loop
    make = pieced_driver(OPENAI_PATH, openai_body(MODEL, SIZES[size]))

    async def main() -> None:
        with tempfile.TemporaryDirectory() as workdir:
            app = build(app_name, Path(workdir))
            await serve(app, make, 50)  # the session, its connection, the caches
            if not calls:
                await serve(app, make, n)
                return
            profile = cProfile.Profile()
            profile.enable()
            await serve(app, make, n)
            profile.disable()
        dump = os.environ.get("BENCH_PROFILE_OUT")
        if dump:
            profile.dump_stats(f"{dump}/{app_name}-{size}.prof")
        text = io.StringIO()
        stats = pstats.Stats(profile, stream=text)
        stats.sort_stats("tottime").print_stats(60)
        print(f"{n} requests\n{text.getvalue()}")

    asyncio.run(main())


def _count(app: str, size: str, n: int) -> int:
    keep = os.environ.get("BENCH_CALLGRIND_DIR")
    out = f"{keep}/callgrind.gateway-floor-{app}-{size}-{n}" if keep else "/dev/null"
    cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]
    cmd += [PYTHON, __file__, "--child", app, size, str(n)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, check=False)
    found = _COLLECTED.findall(done.stderr)
    if done.returncode != 0 or not found:
        raise RuntimeError(f"{app} {size} failed: {done.stderr[-2000:]!r}")
    return int(found[-1])


def count(apps: list[str], sizes: list[str], n_1kb: int) -> dict[tuple[str, str], float]:
    """Instructions per request of each app at each size (two counts at a time)."""
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        runs = {
            (app, size, k): pool.submit(_count, app, size, k)
            for size in sizes
            for app in apps
            for k in (0, requests_at(size, n_1kb))
        }
        return {
            (app, size): (runs[app, size, n].result() - runs[app, size, 0].result()) / n
            for size in sizes
            for app in apps
            for n in [requests_at(size, n_1kb)]
        }


def table(apps: list[str], sizes: list[str], counts: dict[tuple[str, str], float]) -> str:
    lines = ["| instructions per request, in process | " + " | ".join(sizes) + " |"]
    lines.append("|---|" + "---:|" * len(sizes))
    for app in apps:
        cells = " | ".join(f"{counts[app, size] / 1000:,.1f}k" for size in sizes)
        lines.append(f"| {APPS[app]} | {cells} |")
    if "stacked" in apps and "gateway" in apps:
        cells = " | ".join(
            f"{(counts['gateway', s] - counts['stacked', s]) / 1000:+,.1f}k" for s in sizes
        )
        name = "the forwarding app over the floor's endpoint (gateway - stacked)"
        lines.append(f"| {name} | {cells} |")
    if "floor" in apps and "gateway" in apps:
        cells = " | ".join(f"{counts['floor', s] / counts['gateway', s]:.2f}" for s in sizes)
        lines.append(f"| floor / gateway | {cells} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--sizes", default="1KB,128KB", help=f"comma-separated, of {list(SIZES)}")
    parser.add_argument(
        "--apps", default="floor,necessary,stacked,gateway", help=f"of {list(APPS)}"
    )
    parser.add_argument("--requests", type=int, default=2000, help="requests at 1 KB")
    parser.add_argument("--calls", metavar="APP", help="cProfile one app instead of counting")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--child-calls", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        app, size, n = args.child
        _child(app, size, int(n), args.child_calls)
        return 0
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    apps = [a.strip() for a in args.apps.split(",") if a.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        procs = Processes(Path(tmp))
        try:
            with mock_upstream(procs) as mock:
                os.environ["BENCH_UPSTREAM"] = mock
                if args.calls:
                    for size in sizes:
                        n = requests_at(size, args.requests)
                        cmd = [PYTHON, __file__, "--child", args.calls, size, str(n)]
                        subprocess.run([*cmd, "--child-calls"], cwd=ROOT, check=True)
                    return 0
                counts = count(apps, sizes, args.requests)
        finally:
            procs.close()
    print(table(apps, sizes, counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
