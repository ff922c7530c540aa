"""Section 2: the bare app, the minimal reference middleware and the stacked app, each served
by one uvicorn worker and driven by wrk, in turns (all three running, one loaded at a time).

uvicorn runs pinned to core 0 (`taskset -c 0`), wrk pinned to core 1, posting an Anthropic
conversation of each body size; no upstream is involved (the app answers at once).
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

from _harness import (
    ANTHROPIC_PATH,
    SIZES,
    Processes,
    Result,
    Target,
    anthropic_body,
    compare,
    free_port,
    measure_side_by_side,
    uvicorn_cmd,
)
from _inproc import ENV, write_config

SECTION = "2 served"
SERVED = (
    ("bare app", "_apps:bare"),
    # What any middleware that reads and parses the body costs here: the floor under the stack.
    ("minimal middleware (reference)", "_apps:minimal_app"),
    ("switchyard_stack", "_apps:stacked_app"),
)


def run(
    procs: Processes,
    *,
    conns: list[int],
    secs: float,
    warmup: float,
    repeat: int = 1,
    sizes: Sequence[str] = ("1KB",),
) -> list[Result]:
    config = write_config(procs.workdir)
    # The canaried model: every policy has work to do.
    bodies = {size: anthropic_body("claude-opus-5", SIZES[size]) for size in sizes}
    targets: list[Target] = []
    started: list[subprocess.Popen[bytes]] = []
    try:
        # All three up at once, measured in turns (`measure_interleaved`).
        for name, target in SERVED:
            port = free_port()
            env = {**ENV, "BENCH_CONFIG": str(config)}
            proc = procs.start(
                f"served-{name.replace(' ', '-')}", uvicorn_cmd(target, port), port=port, env=env
            )
            started.append(proc)
            targets.append(Target(name, f"http://127.0.0.1:{port}{ANTHROPIC_PATH}", proc.pid))
        results = measure_side_by_side(
            procs,
            targets,
            bodies,
            section=SECTION,
            conns=conns,
            secs=secs,
            warmup=warmup,
            repeat=repeat,
            expect_header=lambda name: "x-switchyard-model" if "stack" in name else None,
        )
    finally:
        for proc in started:
            procs.stop(proc)
    compare(results, "bare app")
    return results
