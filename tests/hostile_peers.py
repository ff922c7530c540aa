"""Hostile peers for the ext_proc server, and the server in a child process to measure.

`Served` runs `start_server` in a child process (run this module as a script), so that its
memory (RSS from /proc) is the server's alone, and asks it for `stats()`: what it still holds
(connections, streams, buffered bytes, flights, probes, health watchers). `Peer` is an HTTP/2
client written on the `h2` library that does what Envoy never would: resets streams as fast
as it opens them, stops reading, lies in a gRPC length prefix, floods header blocks. Both
serve either transport; the h2-only counters are absent from a grpcio server's stats.

Loopback only; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
import msgspec

from extproc_helpers import request_body, request_headers, sets
from switchyard_mw._protos.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from switchyard_mw._protos.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

HOST = "127.0.0.1"
PROCESS = b"/envoy.service.ext_proc.v3.ExternalProcessor/Process"


def grpc_headers(
    path: bytes = PROCESS, extra: Iterable[tuple[bytes, bytes]] = ()
) -> list[tuple[bytes, bytes]]:
    """The request headers a gRPC client opens a call to `path` with, then `extra`."""
    return [
        (b":method", b"POST"),
        (b":scheme", b"http"),
        (b":path", path),
        (b":authority", b"extproc"),
        (b"content-type", b"application/grpc"),
        (b"te", b"trailers"),
        *extra,
    ]


CHECK = b"/grpc.health.v1.Health/Check"
WATCH = b"/grpc.health.v1.Health/Watch"
CONFIG = """
[llm_clients.a]
base_url = "https://prov.example"
api_key_env = "KEY_A"
models = ["m", "m-base", "m-var"]
envoy_cluster = "prov"

[canaries."m-base"]
variants = { "m-var" = 100.0 }
"""
"""`m-base` is always rewritten to `m-var`: its body comes back whole, as a body mutation."""
WAIT_SECS = 20.0
"""The longest any wait here lasts."""


def grpc_message(payload: bytes, *, claimed: int | None = None, compressed: bool = False) -> bytes:
    """gRPC's framing: a flag byte, a 4-byte length (`claimed`, when lying), the payload."""
    size = len(payload) if claimed is None else claimed
    return bytes([1 if compressed else 0]) + size.to_bytes(4, "big") + payload


def chat_body(model: str = "m", size: int = 0) -> bytes:
    """An Anthropic Messages body for `model`, padded to about `size` bytes."""
    text = "q" + "x" * max(0, size - 80)
    return msgspec.json.encode(
        {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": text}]}
    )


def headers_message(request_id: str = "rid-1") -> bytes:
    return request_headers(extra={"x-request-id": request_id}).SerializeToString()


def body_message(body: bytes) -> bytes:
    return request_body(body).SerializeToString()


# -- the server, in a child process -------------------------------------------------------------


class Served:
    """The ext_proc server in a child process; `port`, `stats()`, `rss()`, `log()`, `stop()`."""

    def __init__(
        self,
        tmp: Path,
        *,
        transport: str = "frames",
        limits: dict[str, Any] | None = None,
        max_message_bytes: int | None = None,
        nofile: int | None = None,
        spare_fds: int | None = None,
    ) -> None:
        spec = {
            "transport": transport,
            "limits": limits or {},
            "max_message_bytes": max_message_bytes,
            "spare_fds": spare_fds,
        }
        self.log_path = tmp / "server.log"
        env = {**os.environ, "KEY_A": "ka", "PYTHONPATH": _pythonpath()}

        def limit_files() -> None:
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, __file__, json.dumps(spec)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                preexec_fn=limit_files,
            )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the server did not start: {self.log()}"
        self.port: int = json.loads(line)["port"]

    def stats(self) -> dict[str, int]:
        """What the server holds now (after a garbage collection), and its RSS."""
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(b"stats\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the server died: {self.log()}"
        stats: dict[str, int] = json.loads(line)
        return stats

    async def astats(self) -> dict[str, int]:
        return await asyncio.to_thread(self.stats)

    async def settled(self, **expected: int) -> dict[str, int]:
        """Wait (bounded) until the stats show `expected` (e.g. streams=0); the last stats."""
        deadline = time.monotonic() + WAIT_SECS
        while True:
            stats = await self.astats()
            if all(stats.get(k, v) == v for k, v in expected.items()):  # h2's keys: h2 only
                return stats
            assert time.monotonic() < deadline, f"never settled to {expected}: {stats}"
            await asyncio.sleep(0.1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


def _pythonpath() -> str:
    tests = str(Path(__file__).parent)
    return os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH", "")) if p)


# -- good requests ------------------------------------------------------------------------------


async def good_requests(port: int, count: int = 10) -> list[float]:
    """`count` real ext_proc requests (headers, then a body) over a fresh gRPC channel, each
    routed; their latencies in seconds."""
    latencies = []
    body = chat_body("m")
    async with grpc.aio.insecure_channel(f"{HOST}:{port}") as channel:
        stub = ep_grpc.ExternalProcessorStub(channel)
        for i in range(count):
            started = time.perf_counter()
            call = stub.Process(
                iter([request_headers(extra={"x-request-id": f"good-{i}"}), request_body(body)])
            )
            answers = await asyncio.wait_for(_all(call), WAIT_SECS)
            latencies.append(time.perf_counter() - started)
            assert sets(answers[1])["x-switchyard-cluster"] == b"prov"
    return latencies


async def _all(call: Any) -> list[ep.ProcessingResponse]:
    return [answer async for answer in call]


def within_normal_latency(latencies: Sequence[float], baseline: Sequence[float]) -> bool:
    """The median within a generous margin of the warm-up's (the machine is shared)."""
    return statistics.median(latencies) <= 20 * statistics.median(baseline) + 0.5


# -- a hostile HTTP/2 client --------------------------------------------------------------------


class Peer:
    """One HTTP/2 connection driven by hand. Received DATA is acknowledged (its window given
    back) only while `acknowledge` is True."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.h2 = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding=None)
        )
        self.events: list[h2.events.Event] = []
        self.acknowledge = True
        self.eof = False

    @classmethod
    async def connect(cls, port: int, *, window: int | None = None, preface: bool = True) -> Peer:
        """Connect and (with `preface`) send the preface and SETTINGS; `window` is the stream
        and connection window offered to the server (0: it may send no DATA at all)."""
        reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, port), WAIT_SECS)
        peer = cls(reader, writer)
        if preface:
            if window is not None:
                peer.h2.local_settings = h2.settings.Settings(
                    client=True,
                    initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window},
                )
            peer.h2.initiate_connection()
            if window is not None and window > 65535:
                peer.h2.increment_flow_control_window(window - 65535)
            await peer.flush()
        return peer

    async def flush(self, secs: float = WAIT_SECS) -> bool:
        """Write what h2 has to send; False when the server did not take it within `secs`."""
        self.writer.write(self.h2.data_to_send())
        try:
            await asyncio.wait_for(self.writer.drain(), secs)
        except (TimeoutError, ConnectionError):
            return False
        return True

    def open(
        self, path: bytes = PROCESS, *, end: bool = False, extra: Iterable[tuple[bytes, bytes]] = ()
    ) -> int:
        sid: int = self.h2.get_next_available_stream_id()
        self.h2.send_headers(sid, grpc_headers(path, extra), end_stream=end)
        return sid

    async def send(self, sid: int, data: bytes, *, end: bool = False) -> None:
        """`data` on stream `sid`, in frames the server's windows allow (reading its window
        updates when they run out)."""
        view = memoryview(data)
        while view:
            room = min(
                len(view), self.h2.local_flow_control_window(sid), self.h2.max_outbound_frame_size
            )
            if room <= 0:
                await self.flush()
                await self.receive(WAIT_SECS)
                continue
            try:
                self.h2.send_data(sid, view[:room].tobytes())
            except h2.exceptions.StreamClosedError:
                break  # the server ended (or reset) the stream: the rest is of no use
            view = view[room:]
        if end:
            with contextlib.suppress(h2.exceptions.StreamClosedError):
                self.h2.end_stream(sid)
        await self.flush()

    def reset(self, sid: int) -> None:
        self.h2.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)

    async def receive(self, secs: float) -> list[h2.events.Event]:
        """One read's events (none when nothing came within `secs`)."""
        try:
            data = await asyncio.wait_for(self.reader.read(1 << 20), secs)
        except TimeoutError:
            return []
        except ConnectionError:
            data = b""
        if not data:
            self.eof = True
            return []
        events = self.h2.receive_data(data)
        for event in events:
            if isinstance(event, h2.events.DataReceived) and self.acknowledge:
                with contextlib.suppress(h2.exceptions.StreamClosedError):
                    self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        self.writer.write(self.h2.data_to_send())
        self.events.extend(events)
        return events

    async def until(
        self, matches: Callable[[h2.events.Event], bool], secs: float = WAIT_SECS
    ) -> h2.events.Event | None:
        """The first event (seen so far or coming) that `matches`; None at EOF or after `secs`."""
        deadline = time.monotonic() + secs
        seen = 0
        while True:
            for event in self.events[seen:]:
                if matches(event):
                    return event
            seen = len(self.events)
            left = deadline - time.monotonic()
            if self.eof or left <= 0:
                return None
            await self.receive(left)

    async def closed_by_server(self, secs: float = WAIT_SECS) -> bool:
        """Read (and drop) until the server closes the connection; False at `secs`."""
        deadline = time.monotonic() + secs
        while time.monotonic() < deadline:
            try:
                data = await asyncio.wait_for(
                    self.reader.read(1 << 20), deadline - time.monotonic()
                )
            except TimeoutError:
                return False
            except ConnectionError:
                return True
            if not data:
                return True
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self.events.extend(self.h2.receive_data(data))
        return False

    def trailers(self, sid: int) -> dict[bytes, bytes] | None:
        """The trailers (or trailers-only headers) stream `sid` ended with, if it has."""
        for event in self.events:
            if isinstance(event, h2.events.TrailersReceived) and event.stream_id == sid:
                return dict(event.headers)  # type: ignore[arg-type]
            if isinstance(event, h2.events.ResponseReceived) and event.stream_id == sid:
                headers = dict(event.headers)  # type: ignore[arg-type]
                if b"grpc-status" in headers:
                    return headers
        return None

    def close(self) -> None:
        self.writer.transport.abort()


def status_of(peer: Peer, sid: int) -> int | None:
    trailers = peer.trailers(sid)
    return None if trailers is None else int(trailers[b"grpc-status"])


def goaway(peer: Peer) -> h2.events.ConnectionTerminated | None:
    for event in peer.events:
        if isinstance(event, h2.events.ConnectionTerminated):
            return event
    return None


async def h2load(args: Sequence[str], secs: float = 60) -> str:
    """Run Debian's h2load (nghttp2-client); its output."""
    proc = await asyncio.create_subprocess_exec(
        "h2load", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await asyncio.wait_for(proc.communicate(), secs)
    return out.decode(errors="replace")


# -- the child ------------------------------------------------------------------------------


def _rss(status: BinaryIO) -> int:
    """Resident memory after a collection, with freed heap handed back (so what is counted
    is what is still held); `status` is /proc/self/status, opened once (it is read at the fd
    limit too)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    status.seek(0)
    for line in status.read().splitlines():
        if line.startswith(b"VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _stats(server: Any, status: BinaryIO) -> dict[str, int]:
    servicer = server.servicer
    stats = {
        "rss": _rss(status),
        "flights": len(servicer.flights),
        "probes": sum(s.probe_in_flight for s in servicer.policies.pool.status()),
    }
    h2server = getattr(server._stop, "__self__", None)  # the bound H2Server.stop, for h2
    if h2server is not None:
        connections = list(h2server.connections)
        stats |= {
            "connections": len(connections),
            "open_connections": h2server.open_connections,
            "streams": sum(len(c.streams) for c in connections),
            "held": h2server.held,
            "watchers": len(h2server.health.watchers),
        }
    return stats


async def _child(spec: dict[str, Any], status: BinaryIO) -> None:
    from switchyard_mw.accounts import build_accounts
    from switchyard_mw.config import parse_config
    from switchyard_mw.extproc import Policies, start_server
    from switchyard_mw.extproc.h2_transport import DEFAULT_MESSAGE_BYTES, H2Limits

    config = parse_config(CONFIG)
    policies = Policies(config, build_accounts(config, {"KEY_A": "ka"}))
    limits = None
    if spec["transport"] != "grpcio":
        size = spec["max_message_bytes"] or DEFAULT_MESSAGE_BYTES
        limits = H2Limits.for_message_size(size, **spec["limits"])
    server = await start_server(
        policies, f"{HOST}:0", transport=spec["transport"], h2_limits=limits
    )
    hog = _hog_fds(spec["spare_fds"])
    print(json.dumps({"port": server.port}), flush=True)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    try:
        while line := await reader.readline():
            if line.strip() == b"stats":
                sys.stdout.write(json.dumps(_stats(server, status)) + "\n")
                sys.stdout.flush()
    finally:
        for fd in hog:
            os.close(fd)
        await server.stop(grace_secs=0)


def _hog_fds(spare: int | None) -> list[int]:
    """Open files until only `spare` descriptors are left (None: open none)."""
    if spare is None:
        return []
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = len(os.listdir("/proc/self/fd"))
    return [os.open(os.devnull, os.O_RDONLY) for _ in range(soft - in_use - spare)]


if __name__ == "__main__":
    ctypes.CDLL("libc.so.6")  # loaded, and /proc/self/status opened, before descriptors run out
    with Path("/proc/self/status").open("rb") as proc_status:
        asyncio.run(_child(json.loads(sys.argv[1]), proc_status))
