"""`switchyard-mw extproc --workers N`: N processor processes sharing one TCP port.

Each worker is a whole processor (its own event loop, gRPC server and account pool) bound with
SO_REUSEPORT; the kernel spreads Envoy's connections among them. Python runs one thread of
code per process, so this is how one processor host uses more than one core.

What stays per worker: account health, unless `[state] backend = "redis"` shares it; and the
requests in flight that the two filter levels meet in. The latter holds up because each Envoy
worker thread sends all its ext_proc streams over one HTTP/2 connection, which the kernel hands
to one worker; should a request's streams still land apart (a reconnect), it only misses the
in-request failover. One Envoy thread (`--concurrency 1`) opens one connection: only one
worker would then get work.

The parent process starts the workers (spawned, not forked: gRPC's threads do not survive a
fork), reports the address once all listen, and on SIGTERM or SIGINT stops them all gracefully
(each turns NOT_SERVING and lets its streams finish). A worker that dies stops the rest.
With a `loader`, a SIGHUP to the parent is passed on to every worker, and each reloads its
config itself (a SIGHUP to one worker's pid reloads that one).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging.config
import multiprocessing
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any, TextIO

from ..accounts import build_accounts
from ..config import Config
from ..engine.early_signal import blocked_for_children, hold_early
from ..engine.reload import RELOAD_SIGNAL, Loader
from ..errors import ListenError, StartupError
from .server import DEFAULT_TRANSPORT, GRACE_SECS, ExtProcServer, Transport, parse_listen, serve

START_SECS = 60.0
"""How long the workers may take to listen."""


def run_workers(
    config: Config,
    listen: str,
    workers: int,
    *,
    err: TextIO,
    transport: Transport = DEFAULT_TRANSPORT,
    loader: Loader | None = None,
    log_config: dict[str, Any] | None = None,
    announce: Callable[[str, int], None] | None = None,
) -> int:
    """The CLI's `--workers N`: 2 for a bad count, address or missing key (checked once, here,
    before any worker starts), 1 when the workers cannot listen, else `serve_workers`'s.
    `announce(address, workers)` says they listen (default: a line on `err`); each worker puts
    `log_config` in force (the parent's `logging.config.dictConfig`)."""
    if workers < 1:
        print(f"--workers {workers}: must be at least 1", file=err)
        return 2
    try:
        build_accounts(config)  # a missing key is named once, not by every worker
    except StartupError as exc:
        print(str(exc), file=err)
        return 2
    host = parse_listen(listen).rpartition(":")[0]

    def ready(port: int) -> None:
        where = f"{host}:{port}"
        if announce is not None:
            announce(where, workers)
            return
        print(
            f"switchyard-mw extproc listening on {where} ({workers} workers)", file=err, flush=True
        )

    try:
        return serve_workers(
            config,
            listen,
            workers,
            ready=ready,
            transport=transport,
            loader=loader,
            log_config=log_config,
        )
    except ValueError as exc:
        print(f"--listen {exc}", file=err)
        return 2
    except OSError as exc:
        print(f"cannot serve on {listen}: {exc}", file=err)
        return 1


def serve_workers(
    config: Config,
    listen: str,
    workers: int,
    *,
    ready: Callable[[int], None] | None = None,
    grace_secs: float = GRACE_SECS,
    transport: Transport = DEFAULT_TRANSPORT,
    loader: Loader | None = None,
    log_config: dict[str, Any] | None = None,
) -> int:
    """Run `workers` processes on `listen` until SIGTERM or SIGINT; the exit status (0 when
    stopped by a signal and every worker stopped cleanly). `ready` gets the bound port; each
    worker puts `log_config` in force (spawned, it inherits none).

    Raises ValueError for a unix socket address (it cannot be shared this way), `ListenError`
    (an OSError) when the workers cannot listen.
    """
    address = parse_listen(listen)
    if address.startswith("unix:"):
        raise ValueError(f"{listen!r}: --workers needs HOST:PORT (a unix socket is not shared)")
    host, _, port_text = address.rpartition(":")
    stop = threading.Event()
    signals = (signal.SIGTERM, signal.SIGINT)
    previous = {sig: signal.signal(sig, _setter(stop)) for sig in signals}
    spawn = multiprocessing.get_context("spawn")
    procs: list[BaseProcess] = []
    if loader is not None and RELOAD_SIGNAL is not None:
        previous[RELOAD_SIGNAL] = signal.signal(RELOAD_SIGNAL, _passer(procs))
    try:
        with _reserved(host, int(port_text)) as port:
            pipes = [spawn.Pipe(duplex=False) for _ in range(workers)]
            for i, (_, sender) in enumerate(pipes):
                address = f"{host}:{port}"
                args = (config, address, grace_secs, transport, sender, loader, log_config)
                procs.append(spawn.Process(target=_worker, args=args, name=f"extproc-{i}"))
                with blocked_for_children():  # a SIGHUP waits until the worker takes it
                    procs[-1].start()
                sender.close()  # the child holds its end
            problem = _await_listening([receiver for receiver, _ in pipes], procs, stop)
        if problem is not None:
            raise ListenError(problem)
        if ready is not None and not stop.is_set():
            ready(port)
        while not stop.wait(0.2):
            if any(not proc.is_alive() for proc in procs):
                break  # a worker died: the others stop too
    finally:
        _stop_all(procs, grace_secs)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    clean = all(proc.exitcode == 0 for proc in procs)
    return 0 if stop.is_set() and clean else 1


@contextlib.contextmanager
def _reserved(host: str, port: int) -> Iterator[int]:
    """The port to share: `port`, or for 0 one the kernel picks, held (bound with SO_REUSEPORT,
    not listening) until the block ends so that every worker binds the same one."""
    if port:
        yield port
        return
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind((host.strip("[]"), 0))
        reserved: int = holder.getsockname()[1]
        yield reserved


def _setter(stop: threading.Event) -> Callable[[int, FrameType | None], None]:
    def handler(_signum: int, _frame: FrameType | None) -> None:
        stop.set()

    return handler


def _passer(procs: Sequence[BaseProcess]) -> Callable[[int, FrameType | None], None]:
    """A signal handler that sends the signal on to every live worker."""

    def handler(signum: int, _frame: FrameType | None) -> None:
        for proc in procs:
            if proc.is_alive() and proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signum)

    return handler


def _await_listening(
    receivers: list[Connection], procs: Sequence[BaseProcess], stop: threading.Event
) -> str | None:
    """Wait until every worker listens (or a signal came); what went wrong otherwise."""
    waiting = dict(zip(receivers, procs, strict=True))
    deadline = time.monotonic() + START_SECS
    while waiting and not stop.is_set():
        if time.monotonic() > deadline:
            return f"{len(waiting)} worker(s) did not listen within {START_SECS:.0f} s"
        for receiver in wait(list(waiting), timeout=0.2):
            assert isinstance(receiver, Connection)
            try:
                kind, detail = receiver.recv()
            except EOFError:
                return "a worker exited before listening"
            if kind != "ready":
                return str(detail)
            del waiting[receiver]
    return None


def _stop_all(procs: Sequence[BaseProcess], grace_secs: float) -> None:
    for proc in procs:
        if proc.is_alive() and proc.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()  # SIGTERM: the worker stops gracefully
    for proc in procs:
        proc.join(grace_secs + 5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def _worker(
    config: Config,
    listen: str,
    grace_secs: float,
    transport: Transport,
    conn: Connection,
    loader: Loader | None = None,
    log_config: dict[str, Any] | None = None,
) -> None:
    """One worker: serve until SIGTERM, telling the parent once it listens (or why not)."""
    if loader is not None:
        # Until `serve` handles it: a reload asked for while starting must not kill the worker
        # (it reloads once it serves).
        hold_early()
    if log_config is not None:
        logging.config.dictConfig(log_config)

    def listening(server: ExtProcServer) -> None:
        conn.send(("ready", server.port))

    try:
        asyncio.run(
            serve(
                config,
                listen,
                grace_secs=grace_secs,
                ready=listening,
                reuse_port=True,
                transport=transport,
                loader=loader,
            )
        )
    except Exception as exc:  # reported to the parent, which exits with it
        with contextlib.suppress(OSError):
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None
    finally:
        conn.close()
