"""The two floors of section 3, phase by phase: where a request's CPU goes, per body size.

    python bench/floor_profile.py                           # 1KB,128KB,1MB
    python bench/floor_profile.py --sizes 1MB --requests 100

Both floors of `_apps.passthrough` (`aiohttp`, the bare pass-through; `aiohttp-read`, the
necessary-work floor: the same plus one `wire.read_request`) are built in this process and
driven through hand-made ASGI scope/receive/send, the body handed over in pieces of 64 KiB
(as uvicorn's flow control does), each floor forwarding with its own aiohttp session to the
bench's mock upstream (an Envoy in another process, not counted). Requests go one at a time.

Per floor and size, in rounds that alternate the floors, thread CPU per request (median of the
rounds) and the part of it spent in each phase, timed by wrappers around the libraries' own
functions (two clock reads each, the same in both floors): receiving the body (Starlette's
`Request.body`), the read (`wire.read_request`), forwarding (aiohttp's `ClientSession._request`,
the request sent and the answer's head read, and `ClientResponse.read`, its body), answering
(Starlette's `Response.__call__`); the rest is routing, the ASGI call, the connection's release
and the loop. Also the garbage collector's share (`gc.callbacks`) and its collections per
request by generation, and page faults per request.

The read alone is measured too, in the same process, on the same bytes every time and on a
fresh copy each time (a server reads a body it has just assembled, not one already in the
cache): the figures the necessary-work floor's extra cost is to be read against.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import logging
import os
import resource
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (
    BENCH,
    OPENAI_PATH,
    SIZES,
    Processes,
    median,
    mock_upstream,
    openai_body,
    pick_sizes,
)
from _inproc import pieced_driver

from switchyard_mw.asgi._types import ASGIApp

FLOORS = {"aiohttp": "pass-through aiohttp", "aiohttp-read": "necessary-work floor"}
MODEL = "gpt-4o-mini"
PHASES = ("receive the body", "read_request", "forward", "answer")


class Clock:
    """Thread CPU per phase, and the garbage collector's (a `gc.callbacks` entry)."""

    def __init__(self) -> None:
        self.ns = dict.fromkeys(PHASES, 0)
        self.gc_ns = 0
        self.collections = [0, 0, 0]
        self._gc_started = 0

    def reset(self) -> None:
        self.ns = dict.fromkeys(PHASES, 0)
        self.gc_ns = 0
        self.collections = [0, 0, 0]

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.thread_time_ns()
        else:
            self.gc_ns += time.thread_time_ns() - self._gc_started
            self.collections[info["generation"]] += 1

    def timed(self, phase: str, func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        def plain(*args: Any, **kwargs: Any) -> Any:
            started = time.thread_time_ns()
            try:
                return func(*args, **kwargs)
            finally:
                self.ns[phase] += time.thread_time_ns() - started

        @functools.wraps(func)
        async def awaited(*args: Any, **kwargs: Any) -> Any:
            # Requests go one at a time: what the loop runs while this waits is this request's.
            started = time.thread_time_ns()
            try:
                return await func(*args, **kwargs)
            finally:
                self.ns[phase] += time.thread_time_ns() - started

        return awaited if asyncio.iscoroutinefunction(func) else plain


@contextlib.contextmanager
def phases_timed(clock: Clock) -> Iterator[None]:
    """The phases' functions wrapped by `clock`, restored on exit; the floors must be built
    inside (`_apps` takes `read_request` from its module when it builds one)."""
    import aiohttp
    from starlette.requests import Request
    from starlette.responses import Response

    import switchyard_mw.wire

    places: list[tuple[Any, str, str]] = [
        (Request, "body", "receive the body"),
        (switchyard_mw.wire, "read_request", "read_request"),
        (aiohttp.ClientSession, "_request", "forward"),
        (aiohttp.ClientResponse, "read", "forward"),
        (Response, "__call__", "answer"),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in places]
    try:
        for owner, name, phase in places:
            setattr(owner, name, clock.timed(phase, getattr(owner, name)))
        gc.callbacks.append(clock)
        yield
    finally:
        gc.callbacks.remove(clock)
        for owner, name, func in saved:
            setattr(owner, name, func)


@dataclass
class Figures:
    """One floor at one size: per request, one entry per round."""

    cpu_ms: list[float] = field(default_factory=list)
    phases_ms: dict[str, list[float]] = field(default_factory=dict)
    gc_ms: list[float] = field(default_factory=list)
    collections: list[list[float]] = field(default_factory=list)
    faults: list[float] = field(default_factory=list)


async def serve(app: ASGIApp, make: Callable[..., Any], n: int) -> None:
    for _ in range(n):
        scope, receive, send, sent = make()
        await app(scope, receive, send)
        if sent[0]["status"] != 200:
            raise RuntimeError(f"the floor answered {sent[0]['status']}: the profile is wrong")


async def one_round(
    app: ASGIApp, make: Callable[..., Any], n: int, clock: Clock, into: Figures
) -> None:
    clock.reset()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    started = time.thread_time_ns()
    await serve(app, make, n)
    spent = time.thread_time_ns() - started
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    into.cpu_ms.append(spent / n / 1e6)
    for phase, ns in clock.ns.items():
        into.phases_ms.setdefault(phase, []).append(ns / n / 1e6)
    into.gc_ms.append(clock.gc_ns / n / 1e6)
    into.collections.append([c / n for c in clock.collections])
    into.faults.append(faults / n)


def read_alone(body: bytes, n: int, rounds: int) -> tuple[float, float]:
    """`wire.read_request` on `body`, thread CPU ms per call (median of `rounds`): on the same
    bytes every time (in the cache after the first), and on a fresh copy each time, made
    untimed just before, as a server's read gets a body it has just assembled."""
    from switchyard_mw.wire import WIRE_PATHS, read_request

    wire = WIRE_PATHS[OPENAI_PATH]
    same, fresh = [], []
    for _ in range(rounds):
        started = time.thread_time_ns()
        for _ in range(n):
            read_request(wire, body)
        same.append((time.thread_time_ns() - started) / n / 1e6)
        spent = 0
        for _ in range(n):
            copy = bytes(bytearray(body))
            started = time.thread_time_ns()
            read_request(wire, copy)
            spent += time.thread_time_ns() - started
        fresh.append(spent / n / 1e6)
    return median(same), median(fresh)


def requests_at(size: str, n_1kb: int) -> int:
    """About the bytes of `n_1kb` 1 KB requests, at least 20."""
    return max(20, n_1kb * SIZES["1KB"] // SIZES[size])


async def measure(
    size: str, n_1kb: int, rounds: int
) -> tuple[dict[str, Figures], tuple[float, float]]:
    import _apps

    body = openai_body(MODEL, SIZES[size])
    make = pieced_driver(OPENAI_PATH, body)
    n = requests_at(size, n_1kb)
    clock = Clock()
    with phases_timed(clock):
        apps = {label: _apps.passthrough(kind) for kind, label in FLOORS.items()}
        figures = {label: Figures() for label in apps}
        for app in apps.values():
            await serve(app, make, max(5, n // 5))  # the session, its connection, the caches
        for i in range(rounds):
            for label in list(apps) if i % 2 == 0 else list(reversed(apps)):
                await one_round(apps[label], make, n, clock, figures[label])
    return figures, read_alone(body, n, rounds)


def report(size: str, figures: dict[str, Figures], read_ms: tuple[float, float]) -> str:
    labels = list(figures)
    lines = [
        f"**{size}** (thread CPU ms per request, median of the rounds; `wire.read_request` "
        f"alone on the same bytes: {read_ms[0]:.3f} ms, on a fresh copy each time: "
        f"{read_ms[1]:.3f} ms)\n",
        "| | " + " | ".join(labels) + " | difference |",
        "|---|" + "---:|" * (len(labels) + 1),
    ]

    def row(name: str, values: Sequence[float], digits: int = 3) -> None:
        cells = " | ".join(f"{v:.{digits}f}" for v in values)
        lines.append(f"| {name} | {cells} | {values[-1] - values[0]:+.{digits}f} |")

    cpu = [median(figures[x].cpu_ms) for x in labels]
    row("whole request", cpu)
    phases = {p: [median(figures[x].phases_ms[p]) for x in labels] for p in PHASES}
    for phase, values in phases.items():
        row(phase, values)
    row("the rest", [c - sum(v[i] for v in phases.values()) for i, c in enumerate(cpu)])
    row("of all: the garbage collector", [median(figures[x].gc_ms) for x in labels])
    for gen in range(3):
        row(
            f"gen {gen} collections",
            [median([c[gen] for c in figures[x].collections]) for x in labels],
            2,
        )
    row("page faults", [median(figures[x].faults) for x in labels], 1)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--sizes", default="1KB,128KB,1MB", help=f"comma-separated, of {list(SIZES)}"
    )
    parser.add_argument("--requests", type=int, default=2000, help="requests per round at 1 KB")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per floor")
    parser.add_argument("--out", type=Path, default=BENCH / "out", help="results directory")
    args = parser.parse_args(argv)
    try:
        sizes = pick_sizes(args.sizes)
    except ValueError as exc:
        parser.error(str(exc))
    out: Path = args.out.resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    procs = Processes(out / "logs")
    # The floors' sessions live as long as their loop (one per size), as in a server; asyncio
    # would log each as unclosed when the loop ends.
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    texts = []
    try:
        with mock_upstream(procs) as mock:
            os.environ["BENCH_UPSTREAM"] = mock
            for size in sizes:
                figures, read_ms = asyncio.run(measure(size, args.requests, args.rounds))
                texts.append(report(size, figures, read_ms))
                print(texts[-1] + "\n", flush=True)
    finally:
        procs.close()
    (out / "floor_profile.md").write_text("\n\n".join(texts) + "\n")
    print(f"({out / 'floor_profile.md'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
