"""Section 4: Envoy in front of the mock upstream, without a processor and with switchyard's.

Layout: the gateway tier (the front Envoy, `--concurrency 1`, and the processor,
`switchyard-mw extproc`) on core 0; wrk and the mock upstream on core 1. "With processor" is
`examples/envoy/envoy.yaml` as shipped (a router-level ext_proc filter buffering the body, and
an upstream-level one on the provider's cluster), only its ports swapped and its tracer
removed (no collector runs here); "without" is a plain route to the same cluster. Processor
CPU per request is the processor process's utime+stime over the run.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from _harness import (
    ANTHROPIC_PATH,
    EXAMPLE_KEYS,
    PYTHON,
    ROOT,
    SERVER_CORE,
    SIZES,
    Processes,
    Result,
    Skip,
    anthropic_body,
    compare,
    free_port,
    hcm,
    measure_path,
    pinned,
    start_envoy,
)

SECTION = "4 envoy"
ENVOY_PROC = "Envoy + switchyard-mw extproc"
ENVOY_PROC_GRPCIO = "Envoy + switchyard-mw extproc --transport grpcio"
MINIMAL_PROC = "Envoy + minimal Python processor (reference)"
EXAMPLE = ROOT / "examples" / "envoy"


def plain_config(port: int, admin: int, upstream_port: int) -> str:
    cluster: dict[str, Any] = {
        "name": "mock",
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": "mock",
            "endpoints": [
                {
                    "lb_endpoints": [
                        {
                            "endpoint": {
                                "address": {
                                    "socket_address": {
                                        "address": "127.0.0.1",
                                        "port_value": upstream_port,
                                    }
                                }
                            }
                        }
                    ]
                }
            ],
        },
    }
    routes = [{"match": {"prefix": "/"}, "route": {"cluster": "mock", "timeout": "60s"}}]
    config = {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {
            "listeners": [
                {
                    "name": "llm",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
                    "filter_chains": [{"filters": [hcm(routes, [])]}],
                }
            ],
            "clusters": [cluster],
        },
    }
    return json.dumps(config, indent=1)


def drop_block(text: str, key: str) -> str:
    """`text` (block-style YAML) without the block that starts with the line `key:`."""
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    indent: int | None = None
    for line in lines:
        stripped = line.lstrip(" ")
        depth = len(line) - len(stripped)
        if indent is not None:
            if not stripped.strip() or stripped.startswith("#") or depth > indent:
                continue
            indent = None
        if re.match(rf"{re.escape(key)}:\s*$", stripped):
            indent = depth
            continue
        out.append(line)
    return "".join(out)


def processor_config(workdir: Path, upstream: str) -> Path:
    text = (EXAMPLE / "switchyard.toml").read_text()
    text = text.replace("http://127.0.0.1:9100", upstream)
    path = workdir / "extproc.toml"
    path.write_text(text)
    return path


def run(
    procs: Processes,
    mock: str,
    *,
    conns: list[int],
    secs: float,
    warmup: float,
    repeat: int = 1,
    sizes: Sequence[str] = ("1KB",),
) -> tuple[list[Result], list[Skip]]:
    try:
        import switchyard_mw.extproc
        import switchyard_mw.testing.envoy  # noqa: F401
    except ImportError as exc:
        return [], [Skip(SECTION, f"switchyard_mw.extproc cannot be imported: {exc}")]
    if not (EXAMPLE / "envoy.yaml").exists():
        return [], [Skip(SECTION, "examples/envoy/envoy.yaml is missing")]
    workdir = procs.workdir
    upstream_port = int(mock.rsplit(":", 1)[1])
    bodies = {size: anthropic_body("claude-opus-5", SIZES[size]) for size in sizes}
    results: list[Result] = []
    skips: list[Skip] = []

    # Without a processor.
    port, admin = free_port(), free_port()
    envoy = start_envoy(
        procs, "envoy-plain", plain_config(port, admin, upstream_port), port, SERVER_CORE
    )
    try:
        for size, body in bodies.items():
            results += measure_path(
                f"http://127.0.0.1:{port}{ANTHROPIC_PATH}",
                body,
                workdir,
                section=SECTION,
                name="Envoy, no processor",
                conns=conns,
                secs=secs,
                warmup=warmup,
                cpu_pid=envoy.pid,
                repeat=repeat,
                ours=procs.pids(),
                note="CPU: Envoy",
                size=size,
            )
    finally:
        procs.stop(envoy)

    # With a processor: the example's config as shipped; switchyard's, then the reference.
    config = processor_config(workdir, mock)
    extproc = [PYTHON, "-m", "switchyard_mw.cli", "extproc", "--config", str(config)]
    processors = [
        (ENVOY_PROC, extproc, "x-switchyard-model"),
        (ENVOY_PROC_GRPCIO, [*extproc, "--transport", "grpcio"], "x-switchyard-model"),
        (MINIMAL_PROC, [PYTHON, str(Path(__file__).with_name("_minimal_extproc.py"))], None),
    ]
    for name, cmd, expect_header in processors:
        measured, skip = _with_processor(
            procs,
            upstream_port,
            bodies,
            name,
            cmd,
            expect_header,
            conns=conns,
            secs=secs,
            warmup=warmup,
            repeat=repeat,
        )
        results += measured
        skips += skip
    compare(results, "Envoy, no processor", cpu=False)  # Envoy's CPU vs the processor's
    return results, skips


def _with_processor(
    procs: Processes,
    upstream_port: int,
    bodies: dict[str, bytes],
    name: str,
    cmd: list[str],
    expect_header: str | None,
    *,
    conns: list[int],
    secs: float,
    warmup: float,
    repeat: int,
) -> tuple[list[Result], list[Skip]]:
    """Envoy with the example config in front of the processor `cmd` (given `--listen`)."""
    try:
        with behind_envoy(procs, upstream_port, cmd) as (url, pid):
            results: list[Result] = []
            for size, body in bodies.items():
                results += measure_path(
                    url,
                    body,
                    procs.workdir,
                    section=SECTION,
                    name=name,
                    conns=conns,
                    secs=secs,
                    warmup=warmup,
                    cpu_pid=pid,
                    repeat=repeat,
                    ours=procs.pids(),
                    note="CPU: processor",
                    expect_header=expect_header,
                    size=size,
                )
            return results, []
    except NotStarted as exc:
        return [], [Skip(SECTION, f"{name}: {exc}")]


class NotStarted(Exception):
    """A server of the set-up did not start (the text says which, and why)."""


@contextlib.contextmanager
def behind_envoy(procs: Processes, upstream_port: int, cmd: list[str]) -> Iterator[tuple[str, int]]:
    """The processor `cmd` (given `--listen`) with Envoy and the example config in front of
    it, both on the server core: Envoy's URL of the Anthropic path and the processor's pid.
    `NotStarted` when either did not start."""
    from switchyard_mw.testing.envoy import with_ports

    proc_port = free_port()
    cmd = [*cmd, "--listen", f"127.0.0.1:{proc_port}"]
    env = dict(EXAMPLE_KEYS)
    try:
        processor = procs.start("extproc", pinned(SERVER_CORE, cmd), port=proc_port, env=env)
    except (RuntimeError, TimeoutError) as exc:
        raise NotStarted(f"the processor did not start: {str(exc)[:300]}") from None
    port, admin = free_port(), free_port()
    ports = {
        "listener": port,
        "admin": admin,
        "processor": proc_port,
        "upstream": upstream_port,
        "otel": free_port(),
    }
    config = drop_block(with_ports((EXAMPLE / "envoy.yaml").read_text(), ports), "tracing")
    try:
        envoy = start_envoy(procs, "envoy-extproc", config, port, SERVER_CORE)
    except (RuntimeError, TimeoutError) as exc:
        procs.stop(processor)
        raise NotStarted(f"Envoy with the example config did not start: {exc}") from None
    try:
        yield f"http://127.0.0.1:{port}{ANTHROPIC_PATH}", processor.pid
    finally:
        procs.stop(envoy)
        procs.stop(processor)
