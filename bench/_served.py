"""Section 2: the bare app, the minimal reference middleware and the stacked app, each served
by one uvicorn worker and driven by wrk.

uvicorn runs pinned to core 0 (`taskset -c 0`), wrk pinned to core 1, posting an Anthropic
conversation of each body size; no upstream is involved (the app answers at once).
"""

from __future__ import annotations

from collections.abc import Sequence

from _harness import (
    ANTHROPIC_PATH,
    SIZES,
    Processes,
    Result,
    anthropic_body,
    compare,
    free_port,
    measure_path,
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
    results: list[Result] = []
    for name, target in SERVED:
        port = free_port()
        env = {**ENV, "BENCH_CONFIG": str(config)}
        proc = procs.start(
            f"served-{name.replace(' ', '-')}", uvicorn_cmd(target, port), port=port, env=env
        )
        try:
            for size, body in bodies.items():
                results += measure_path(
                    f"http://127.0.0.1:{port}{ANTHROPIC_PATH}",
                    body,
                    procs.workdir,
                    section=SECTION,
                    name=name,
                    conns=conns,
                    secs=secs,
                    warmup=warmup,
                    cpu_pid=proc.pid,
                    repeat=repeat,
                    ours=procs.pids(),
                    expect_header="x-switchyard-model" if "stack" in name else None,
                    size=size,
                )
        finally:
            procs.stop(proc)
    compare(results, "bare app")
    return results
