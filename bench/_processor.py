"""The ext_proc processor's instructions per 1 KB request under real Envoy (`instructions.py --mode
processor`).

The processor (`switchyard-mw extproc --transport T`, the example config) runs under callgrind
behind Envoy (`examples/envoy/envoy.yaml` as shipped, ports swapped, tracer dropped) in front of
the bundled mock provider; h2load sends exactly N requests of 1 KB (or `--sizes`) through Envoy
(2 connections). The figure is (instructions of a run with N - those of the same run with none)
/ N, over the processor process alone: Envoy, the mock and h2load are not counted. Both runs
take the same warm-up, so start-up, imports and warm-up cancel out.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

from _envoy import EXAMPLE, drop_block, processor_config
from _harness import (
    ANTHROPIC_PATH,
    EXAMPLE_KEYS,
    PYTHON,
    Processes,
    anthropic_body,
    free_port,
    start_envoy,
    wait_for_port,
)

TRANSPORTS = ("h2", "frames", "grpcio")
_WARMUP = 60
_COLLECTED = re.compile(rb"Collected : (\d+)")
_HEADERS = (
    "content-type: application/json",
    "x-api-key: anything",
    "anthropic-version: 2023-06-01",
)


def _mock_provider(procs: Processes) -> str:
    port = free_port()
    cmd = [PYTHON, "-m", "switchyard_mw.testing.mock_provider", "--port", str(port)]
    procs.start("mock-provider", [*cmd, "--log-level", "warning"], port=port)
    return f"http://127.0.0.1:{port}"


def _h2load(url: str, body: Path, n: int) -> None:
    """Exactly `n` requests over 2 connections; every one must be a 2xx."""
    cmd = ["h2load", "--h1", "-d", str(body), "-t1", "-n", str(n), "-c", "2"]
    for header in _HEADERS:
        cmd += ["-H", header]
    done = subprocess.run([*cmd, url], capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0 or f"{n} succeeded" not in done.stdout:
        raise RuntimeError(f"h2load: {done.stdout[-800:]}{done.stderr[-800:]}")
    for line in done.stdout.splitlines():
        if line.startswith("status codes:") and int(line.split()[2]) != n:
            raise RuntimeError(f"not every answer was a 2xx: {line}")


def _warm_up(url: str, body: Path, deadline: float) -> None:
    """The first requests through a processor under valgrind may time out in Envoy (imports on
    first use run 50 times slower): retried until `_WARMUP` in a row succeed."""
    while True:
        try:
            _h2load(url, body, _WARMUP)
            return
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def count(transport: str, n: int, workdir: Path, size: int = 1024) -> int:
    """Instructions of one processor process that served `n` requests of `size` bytes after
    the warm-up."""
    from switchyard_mw.testing.envoy import with_ports

    run = workdir / f"processor-{transport}-{size}-{n}"
    run.mkdir(parents=True, exist_ok=True)
    procs = Processes(run)
    try:
        mock = _mock_provider(procs)
        proc_port = free_port()
        config = processor_config(run, mock)
        cmd = [PYTHON, "-m", "switchyard_mw.cli", "extproc", "--config", str(config)]
        cmd += ["--listen", f"127.0.0.1:{proc_port}", "--transport", transport]
        # BENCH_CALLGRIND_DIR keeps each run's profile (callgrind_annotate reads it) there.
        keep = os.environ.get("BENCH_CALLGRIND_DIR")
        profile = f"{keep}/callgrind.{transport}-{size}-{n}" if keep else "/dev/null"
        valgrind = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={profile}", *cmd]
        env = dict(EXAMPLE_KEYS)
        log = run / "processor.log"
        with log.open("wb") as out:
            processor = subprocess.Popen(
                valgrind, env={**os.environ, **env}, stdout=out, stderr=out, start_new_session=True
            )
        try:
            wait_for_port(proc_port, processor, 300, log)
            port = free_port()
            ports = {
                "listener": port,
                "admin": free_port(),
                "processor": proc_port,
                "upstream": int(mock.rsplit(":", 1)[1]),
                "otel": free_port(),
            }
            text = drop_block(with_ports((EXAMPLE / "envoy.yaml").read_text(), ports), "tracing")
            # Under valgrind a message takes 50-100 times as long: Envoy's 2 s would fail some.
            text = re.sub(r"message_timeout: \d+s", "message_timeout: 60s", text)
            envoy = start_envoy(procs, f"envoy-{transport}", text, port, "0-1")
            body = run / "body.json"
            body.write_bytes(anthropic_body("claude-opus-5", size))
            url = f"http://127.0.0.1:{port}{ANTHROPIC_PATH}"
            _warm_up(url, body, time.monotonic() + 300)
            if n:
                _h2load(url, body, n)
            procs.stop(envoy)
        finally:
            os.killpg(processor.pid, signal.SIGTERM)  # a graceful stop: valgrind then reports
            processor.wait(300)
        found = _COLLECTED.findall(log.read_bytes())
        if not found:
            raise RuntimeError(f"no instruction count: {log.read_bytes()[-2000:]!r}")
        return int(found[-1])
    finally:
        procs.close()
