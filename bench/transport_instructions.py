"""Instructions per request of the ext_proc transport alone, fed the bytes a real Envoy sent.

    python bench/transport_instructions.py --record           # record Envoy's bytes (1 KB, 128 KB)
    python bench/transport_instructions.py                    # count each transport on them
    python bench/transport_instructions.py --transports h2 --sizes 1KB
    python bench/transport_instructions.py --handler processor --transports frames

Recording: Envoy (`examples/envoy/envoy.yaml`, one worker) in front of the bundled mock
provider, the processor (`switchyard-mw extproc`, h2) behind a recording proxy that keeps every
read Envoy's side made of its one HTTP/2 connection; h2load sends the requests one at a time
(`-c 1`), so each read belongs to one stream or to the connection. Kept in
`bench/out/envoy-bytes/SIZE.bin` (length-prefixed reads).

Counting: a child process builds the transport's server and one connection on a fake socket,
feeds it the recorded reads of a warm-up (the preface and the first streams), then those of N
more streams, letting the event loop run between reads as a socket would; the handler answers
each message with a fixed small answer (the processor's policies are not counted), or with
`--handler processor` the processor itself answers (`examples/envoy/switchyard.toml`'s
policies, as `switchyard-mw extproc` serves them: the whole per-request cost but the kernel's
and Envoy's, the answers' bytes written nowhere). The figure
is (instructions with N streams - those with none) / N under `valgrind --tool=callgrind`, so
start-up, imports and the warm-up cancel out; counts do not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (
    ANTHROPIC_PATH,
    BENCH,
    EXAMPLE_KEYS,
    PYTHON,
    SIZES,
    Processes,
    anthropic_body,
    free_port,
    pick_sizes,
    start_envoy,
)

if TYPE_CHECKING:
    from switchyard_mw.extproc.h2_transport import EndStream, OpenStream

RECORDINGS = BENCH / "out" / "envoy-bytes"
TRANSPORTS = ("h2", "frames")
_WARMUP = 20
_COLLECTED = re.compile(rb"Collected : (\d+)")
_HEADERS = (
    "content-type: application/json",
    "x-api-key: anything",
    "anthropic-version: 2023-06-01",
)


# --- recording ---------------------------------------------------------------------------------


def _proxy(listen: socket.socket, target: int, reads: list[bytes], stop: threading.Event) -> None:
    """Forwards one connection at a time to `target`, keeping what the client side sent."""
    listen.settimeout(0.2)
    while not stop.is_set():
        try:
            client, _ = listen.accept()
        except TimeoutError:
            continue
        server = socket.create_connection(("127.0.0.1", target))
        threading.Thread(target=_pump, args=(server, client, None), daemon=True).start()
        _pump(client, server, reads)


def _pump(src: socket.socket, dst: socket.socket, reads: list[bytes] | None) -> None:
    try:
        while chunk := src.recv(1 << 20):
            if reads is not None:
                reads.append(chunk)
            dst.sendall(chunk)
    except OSError:
        pass
    finally:
        dst.close()


def record(size: str, requests: int, workdir: Path, into: Path = RECORDINGS) -> Path:
    """Envoy's reads of one ext_proc connection serving `requests` requests of `size`, kept
    in `into`."""
    from _envoy import EXAMPLE, drop_block, processor_config

    from switchyard_mw.testing.envoy import with_ports

    procs = Processes(workdir)
    reads: list[bytes] = []
    stop = threading.Event()
    try:
        port = free_port()
        cmd = [PYTHON, "-m", "switchyard_mw.testing.mock_provider", "--port", str(port)]
        procs.start("mock-provider", [*cmd, "--log-level", "warning"], port=port)
        mock = f"http://127.0.0.1:{port}"
        proc_port = free_port()
        cmd = [PYTHON, "-m", "switchyard_mw.cli", "extproc", "--config"]
        cmd += [str(processor_config(workdir, mock)), "--listen", f"127.0.0.1:{proc_port}"]
        env = dict(EXAMPLE_KEYS)
        procs.start("processor", cmd, port=proc_port, env=env)
        listen = socket.create_server(("127.0.0.1", 0))
        proxy_port = listen.getsockname()[1]
        threading.Thread(target=_proxy, args=(listen, proc_port, reads, stop), daemon=True).start()
        listener = free_port()
        ports = {
            "listener": listener,
            "admin": free_port(),
            "processor": proxy_port,
            "upstream": port,
            "otel": free_port(),
        }
        text = drop_block(with_ports((EXAMPLE / "envoy.yaml").read_text(), ports), "tracing")
        envoy = start_envoy(procs, "envoy", text, listener, "0-1")
        body = workdir / "body.json"
        body.write_bytes(anthropic_body("claude-opus-5", SIZES[size]))
        cmd = ["h2load", "--h1", "-d", str(body), "-t1", "-n", str(requests), "-c", "1"]
        for header in _HEADERS:
            cmd += ["-H", header]
        url = f"http://127.0.0.1:{listener}{ANTHROPIC_PATH}"
        done = subprocess.run([*cmd, url], capture_output=True, text=True, timeout=600, check=False)
        if f"{requests} succeeded" not in done.stdout or "2xx" not in done.stdout:
            raise RuntimeError(done.stdout[-800:])
        procs.stop(envoy)
        time.sleep(0.5)
    finally:
        stop.set()
        procs.close()
    into.mkdir(parents=True, exist_ok=True)
    path = into / f"{size}.bin"
    path.write_bytes(b"".join(struct.pack(">I", len(r)) + r for r in reads))
    return path


def load(path: Path) -> list[bytes]:
    data = path.read_bytes()
    reads: list[bytes] = []
    at = 0
    while at < len(data):
        (n,) = struct.unpack_from(">I", data, at)
        reads.append(data[at + 4 : at + 4 + n])
        at += 4 + n
    return reads


def _streams_in(read: bytes, skip: int) -> set[int]:
    """The stream ids of the HEADERS frames in `read` (after `skip` bytes of preface)."""
    ids: set[int] = set()
    at = skip
    while at + 9 <= len(read):
        length = int.from_bytes(read[at : at + 3], "big")
        if read[at + 3] == 1:
            ids.add(int.from_bytes(read[at + 5 : at + 9], "big") & 0x7FFFFFFF)
        at += 9 + length
    return ids


def reads_for(reads: Sequence[bytes], streams: int) -> list[bytes]:
    """The reads up to (not including) the one that opens stream number `streams` + 1."""
    seen = 0
    for i, read in enumerate(reads):
        skip = 24 if read.startswith(b"PRI * HTTP/2.0") else 0
        seen += len(_streams_in(read, skip))
        if seen > streams:
            return list(reads[:i])
    if seen < streams:
        raise ValueError(f"the recording has {seen} streams, not {streams}")
    return list(reads)


# --- counting ----------------------------------------------------------------------------------


class _Socket(asyncio.Transport):
    """What the connection writes is only counted; it is never paused."""

    written = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += len(data)

    def is_closing(self) -> bool:
        return False

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def can_write_eof(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


HANDLERS = ("fixed", "processor")


def _fixed() -> tuple[OpenStream, EndStream]:
    """A handler that answers every message with the same small answer."""
    from switchyard_mw._protos.envoy.service.ext_proc.v3 import external_processor_pb2 as ep

    answer = ep.ProcessingResponse(request_body=ep.BodyResponse())

    class Fixed:
        def answer(self, request: ep.ProcessingRequest) -> ep.ProcessingResponse:
            return answer

    return lambda _: Fixed(), lambda _: None


async def _processor(workdir: Path) -> tuple[OpenStream, EndStream]:
    """The processor's own handlers, on the example's config (its upstream never called: the
    recording's answers come from Envoy's side)."""
    from _envoy import processor_config

    from switchyard_mw.accounts import build_accounts
    from switchyard_mw.config import load_config
    from switchyard_mw.extproc.policy import Policies
    from switchyard_mw.extproc.servicer import ExtProcServicer

    config = load_config(processor_config(workdir, "http://127.0.0.1:9"))
    environ = {**os.environ, **EXAMPLE_KEYS}
    policies = Policies(config, build_accounts(config, environ), environ=environ)
    await policies.start()
    servicer = ExtProcServicer(policies)
    return servicer.open, servicer.end


def child(transport: str, path: Path, streams: int, handler: str = "fixed") -> None:
    from switchyard_mw.extproc.h2_transport import H2Server, _Connection

    reads = load(path)
    warm = reads_for(reads, _WARMUP)
    more = reads_for(reads, _WARMUP + streams)[len(warm) :]

    async def main() -> None:
        engine = {} if transport == "h2" else {"engine": transport}
        with tempfile.TemporaryDirectory(prefix="sy-count-") as tmp:
            opened, ended = _fixed() if handler == "fixed" else await _processor(Path(tmp))
        server = H2Server(opened, ended, services=(), **engine)  # type: ignore[arg-type]
        connection = _Connection(server)
        sock = _Socket()
        connection.connection_made(sock)
        for batch in (warm, more):
            for read in batch:
                connection.data_received(read)
                await asyncio.sleep(0)  # the message's task answers
                await asyncio.sleep(0)  # and its answer is flushed
        # Every stream was answered and ended (Envoy reset each once answered).
        assert not connection.streams, connection.streams
        assert not connection.closed
        print(f"written {sock.written}", file=sys.stderr)

    asyncio.run(main())


def count(transport: str, path: Path, streams: int, handler: str = "fixed") -> int:
    cmd = [PYTHON, __file__, "--child", transport, str(path), str(streams), handler]
    valgrind = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *cmd]
    done = subprocess.run(valgrind, capture_output=True, timeout=1800, check=False)
    found = _COLLECTED.findall(done.stderr)
    if done.returncode != 0 or not found:
        raise RuntimeError(done.stderr.decode(errors="replace")[-2000:])
    return int(found[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--record", action="store_true", help="record Envoy's bytes first")
    parser.add_argument("--sizes", default="1KB,128KB")
    parser.add_argument("--transports", default=",".join(TRANSPORTS))
    parser.add_argument("--streams", type=int, default=200, help="streams counted")
    parser.add_argument(
        "--handler",
        choices=HANDLERS,
        default="fixed",
        help="who answers: a fixed answer (the transport alone) or the processor's policies",
    )
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child[0], Path(args.child[1]), int(args.child[2]), args.child[3])
        return 0
    sizes = pick_sizes(args.sizes)
    if args.record:
        for size in sizes:
            with tempfile.TemporaryDirectory(prefix="sy-record-") as tmp:
                path = record(size, _WARMUP + args.streams + 10, Path(tmp))
                print(f"{size}: {len(load(path))} reads recorded in {path}")
    for size in sizes:
        path = RECORDINGS / f"{size}.bin"
        for transport in [t for t in args.transports.split(",") if t]:
            none = count(transport, path, 0, args.handler)
            some = count(transport, path, args.streams, args.handler)
            per = (some - none) / args.streams / 1000
            print(f"{size} {transport} ({args.handler}): {per:,.1f} k per stream")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
