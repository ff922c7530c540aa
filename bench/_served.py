"""Section 2: the bare app and the stacked app served by one uvicorn worker, driven by wrk.

uvicorn runs pinned to core 0 (`taskset -c 0`), wrk pinned to core 1, posting the 1 KB
Anthropic body; no upstream is involved (the app answers at once).
"""

from __future__ import annotations

from _harness import (
    ANTHROPIC_PATH,
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


def run(
    procs: Processes, *, conns: list[int], secs: float, warmup: float, repeat: int = 1
) -> list[Result]:
    config = write_config(procs.workdir)
    body = anthropic_body("claude-opus-5")  # the canaried model: every policy has work to do
    results: list[Result] = []
    for name, target in (("bare app", "_apps:bare"), ("switchyard_stack", "_apps:stacked_app")):
        port = free_port()
        env = {**ENV, "BENCH_CONFIG": str(config)}
        proc = procs.start(
            f"served-{name.replace(' ', '-')}", uvicorn_cmd(target, port), port=port, env=env
        )
        try:
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
            )
        finally:
            procs.stop(proc)
    compare(results, "bare app")
    return results
