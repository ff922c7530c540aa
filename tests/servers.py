"""Real servers for live tests: uvicorn on a thread (in-process apps) or a subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from switchyard_mw.testing.envoy import free_port

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def refusing_port() -> Iterator[int]:
    """A loopback port that refuses every connection while the block runs: bound (without
    SO_REUSEADDR), never listening.

    A port only bound and released (`free_port`) may be taken again meanwhile: by a server of
    a later test, or as the local port of an outgoing connection, and a connection to it from
    that very port then connects to itself (TCP's simultaneous open) and waits for an answer
    that never comes, up to the attempt's whole deadline. Held here, the kernel gives it to
    nobody else, and a connection to it is refused at once.
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        yield port


def wait_for_port(port: int, timeout: float = 15.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout} s")


@contextlib.contextmanager
def serve_in_thread(app: Any, port: int | None = None) -> Iterator[str]:
    """Serve an ASGI app with uvicorn on its own thread and loop; yields its base URL."""
    port = port or free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for_port(port)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@contextlib.contextmanager
def example_gateway(
    config_text: str, tmp_path: Path, env: Mapping[str, str] | None = None, *, workers: int = 1
) -> Iterator[str]:
    """`uvicorn examples.starlette_app:app` in a subprocess with this config; yields its URL.

    `workers` > 1 runs that many worker processes behind one port (`uvicorn --workers`).
    """
    with example_gateway_process(config_text, tmp_path, env, workers=workers) as (url, _):
        yield url


@contextlib.contextmanager
def example_gateway_process(
    config_text: str, tmp_path: Path, env: Mapping[str, str] | None = None, *, workers: int = 1
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`example_gateway`, yielding the uvicorn process too; its config is
    `tmp_path/switchyard.toml` and its output `tmp_path/gateway.log`."""
    config = tmp_path / "switchyard.toml"
    config.write_text(config_text)
    port = free_port()
    full_env = {
        **os.environ,
        "SWITCHYARD_CONFIG": str(config),
        "SWITCHYARD_START_MOCK": "0",
        **(env or {}),
    }
    log = (tmp_path / "gateway.log").open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "examples.starlette_app:app",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
            *(["--workers", str(workers)] if workers > 1 else []),
        ],
        cwd=ROOT,
        env=full_env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        try:
            wait_for_port(port)
        except TimeoutError:
            proc.kill()
            raise RuntimeError((tmp_path / "gateway.log").read_text()) from None
        yield f"http://127.0.0.1:{port}", proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def worker_pids(parent: int) -> list[int]:
    """The pids of `parent`'s multiprocessing workers (uvicorn --workers, extproc --workers),
    read from /proc: its children started by `spawn_main` (not its resource tracker)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = (entry / "stat").read_text()
            ppid = int(stat.rpartition(")")[2].split()[1])
            if ppid == parent and b"spawn_main" in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
    return sorted(pids)


def metric_value(base_url: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus sample over series matching `labels`, read from /metrics."""
    text = httpx.get(f"{base_url}/metrics").text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        series, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in series for k, v in labels.items()):
            total += float(value)
    return total


@contextlib.asynccontextmanager
async def serving(app: Any, *, lifespan: str = "off") -> AsyncIterator[str]:
    """`app` under real uvicorn in this event loop, on a free loopback port; yields its URL."""
    # IPPROTO_TCP given explicitly: asyncio then sets TCP_NODELAY on accepted connections,
    # so responses written in two parts do not wait ~40 ms on Nagle's algorithm.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan=lifespan, timeout_graceful_shutdown=1
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(5):
            while not server.started:  # noqa: ASYNC110 - uvicorn exposes no event for this
                await asyncio.sleep(0.005)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
        sock.close()


RawHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def raw_server(handler: RawHandler) -> AsyncIterator[tuple[str, list[int]]]:
    """A raw TCP server on loopback running `handler` per connection (a peer that says exactly
    what a test scripts); yields its base URL and a list counting the connections."""
    connections: list[int] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", connections
    finally:
        server.close()


async def read_http_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One HTTP/1.1 request off `reader`: its head (through the blank line) and its body."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head, await reader.readexactly(length) if length else b""


def stop_tree(proc: subprocess.Popen[bytes], grace: float = 15.0) -> None:
    """Stop a script started with `start_new_session=True` and everything it started (an
    Envoy, a processor, a mock): Ctrl-C first, as a user would, then SIGKILL to the whole
    process group, so a failed test leaves no orphaned Envoy behind."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace)
    with contextlib.suppress(ProcessLookupError):  # the children, even once the script exited
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
