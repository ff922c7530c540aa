"""The grpc.aio ext_proc server against broken and hostile HTTP/2 peers (issue 20's rows).

Each probe runs against the server in its own process (tests/extproc_child.py) so its memory
is the server's alone, and ends with the same three checks: good requests are served, memory
is back within 20% of where it stood after a warm-up round, and no flight or lease is left.
The hostile clients are a few lines each on the `h2` library; loopback only, bounded in
count and time. Where grpcio has no bound for a row, SECURITY.md says so and the test
asserts what does hold.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import msgspec
import pytest

from extproc_helpers import request_body, request_headers, response_headers, sets
from switchyard_mw._protos.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from switchyard_mw._protos.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

CHILD = Path(__file__).parents[1] / "extproc_child.py"
PROCESS = b"/envoy.service.ext_proc.v3.ExternalProcessor/Process"


def body(size: int = 200) -> bytes:
    """An Anthropic body for model `m` (rewritten to `m-var`: its answer carries the body)."""
    text = "x" * max(0, size - 120)
    return msgspec.json.encode(
        {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": text}]}
    )


# --- the server in its own process ------------------------------------------------------------


@dataclass
class Child:
    proc: subprocess.Popen[str]
    port: int

    def state(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write("state\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "the server process is gone"
        result: dict[str, Any] = json.loads(line)
        return result

    def rss_mb(self) -> float:
        """The server's resident memory, once its allocator gave back what is free."""
        self.state()
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))


@contextlib.contextmanager
def child(limits: dict[str, Any] | None = None, *, nofile: int | None = None) -> Iterator[Child]:
    def preexec() -> None:
        if nofile is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    proc = subprocess.Popen(
        [sys.executable, str(CHILD), "grpcio", json.dumps(limits or {})],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=preexec,
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        yield Child(proc, port)
    finally:
        assert proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


# --- good requests, as Envoy sends them -------------------------------------------------------


async def good_request(port: int, deadline_secs: float = 10.0) -> float:
    """One routed request over a fresh channel; its latency in seconds."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = ep_grpc.ExternalProcessorStub(channel)
        started = time.monotonic()
        call = stub.Process(
            iter([request_headers(), request_body(body()), response_headers(200)]),
            timeout=deadline_secs,
        )
        answers = [a async for a in call]
        elapsed = time.monotonic() - started
    assert len(answers) == 3
    assert sets(answers[1])["x-switchyard-cluster"] == b"prov"
    return elapsed


async def warm_up(server: Child, rounds: int = 30) -> float:
    """A round of good requests; the memory after it is the baseline."""
    for _ in range(rounds):
        await good_request(server.port)
    return server.rss_mb()


async def ends_well(server: Child, baseline_mb: float) -> None:
    """Good requests served, memory back within 20% of the baseline, nothing left."""
    for _ in range(5):
        await good_request(server.port)
    deadline = time.monotonic() + 20
    while True:  # freed memory and closed streams settle within a moment, not at once
        state, rss = server.state(), server.rss_mb()
        settled = state == {"flights": 0, "leases": 0, "probes": []}
        if settled and rss <= baseline_mb * 1.2:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"state {state}, {rss:.1f} MB against {baseline_mb:.1f} MB")
        await asyncio.sleep(0.2)


# --- hostile clients: a few lines each on h2 --------------------------------------------------


def grpc_message(payload: bytes, *, claimed: int | None = None, compressed: bool = False) -> bytes:
    """A gRPC length-prefixed message; `claimed` lies about its length."""
    length = len(payload) if claimed is None else claimed
    return struct.pack(">BI", 1 if compressed else 0, length) + payload


@dataclass
class Peer:
    """One raw HTTP/2 connection driven by hand."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    h2: h2.connection.H2Connection
    events: list[h2.events.Event] = field(default_factory=list)

    @classmethod
    async def connect(cls, port: int, settings: dict[int, int] | None = None) -> Peer:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding=None)
        )
        conn.initiate_connection()
        if settings:
            conn.update_settings(settings)
        peer = cls(reader, writer, conn)
        await peer.flush()
        return peer

    async def flush(self) -> None:
        self.writer.write(self.h2.data_to_send())
        await self.writer.drain()

    def ignore_stream_limit(self) -> None:
        """Open streams past what the server advertised, as a hostile peer does."""
        limit = h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS
        self.h2.remote_settings._settings[limit] = collections.deque([1 << 30])

    def open(self, metadata: list[tuple[bytes, bytes]] | None = None) -> int:
        sid: int = self.h2.get_next_available_stream_id()
        headers = [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", PROCESS),
            (b":authority", b"localhost"),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
            *(metadata or []),
        ]
        self.h2.send_headers(sid, headers)
        return sid

    def send(self, sid: int, data: bytes, *, end: bool = False) -> None:
        """Data as far as the server's window allows (the rest is dropped: a probe's bytes)."""
        room = min(len(data), self.h2.local_flow_control_window(sid))
        frame = self.h2.max_outbound_frame_size
        for at in range(0, room, frame):
            last = at + frame >= room
            self.h2.send_data(sid, data[at : min(room, at + frame)], end_stream=end and last)

    async def read(self, secs: float) -> bool:
        """Read what arrives within `secs`; False once the server closed the connection."""
        try:
            data = await asyncio.wait_for(self.reader.read(1 << 16), secs)
        except TimeoutError:
            return True
        if not data:
            return False
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self.events += self.h2.receive_data(data)
        with contextlib.suppress(ConnectionError):
            await self.flush()
        return True

    async def until(self, done: Callable[[], bool], secs: float = 10.0) -> None:
        """Read until `done()` holds (or fail after `secs`): frames come in several reads."""
        end = time.monotonic() + secs
        while not done():
            assert time.monotonic() < end, f"not seen within {secs} s: {self.events}"
            if not await self.read(0.2):
                assert done(), "the server closed the connection"

    def of(self, kind: type[h2.events.Event]) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]

    def ended(self) -> set[int]:
        """The streams the server has ended or reset."""
        kinds = h2.events.StreamReset | h2.events.StreamEnded
        return {e.stream_id for e in self.events if isinstance(e, kinds)}

    async def until_ended(self, sid: int, secs: float) -> None:
        end = time.monotonic() + secs
        while sid not in self.ended():
            assert time.monotonic() < end, f"stream {sid} still open after {secs} s"
            assert await self.read(0.2), "the server closed the connection"

    async def closed_within(self, secs: float) -> bool:
        end = time.monotonic() + secs
        while time.monotonic() < end:
            if not await self.read(min(1.0, end - time.monotonic())):
                return True
        return False

    def close(self) -> None:
        self.writer.close()


async def peers(port: int, count: int) -> list[Peer]:
    return [await Peer.connect(port) for _ in range(count)]


@contextlib.asynccontextmanager
async def connected(port: int, settings: dict[int, int] | None = None) -> AsyncIterator[Peer]:
    peer = await Peer.connect(port, settings)
    try:
        yield peer
    finally:
        peer.close()


def processing_request(message: ep.ProcessingRequest) -> bytes:
    return grpc_message(message.SerializeToString())


async def send_routed(peer: Peer, size: int) -> int:
    """A routed request's headers and body on a new stream, its body as large as `size`."""
    sid = peer.open()
    peer.send(sid, processing_request(request_headers()))
    message = processing_request(request_body(body(size)))
    sent = 0
    while sent < len(message):  # as fast as the server's windows allow
        room = min(len(message) - sent, peer.h2.local_flow_control_window(sid))
        if room == 0:
            if not await peer.read(0.05):
                return sid
            continue
        peer.send(sid, message[sent : sent + room])
        sent += room
        await peer.flush()
    return sid


async def probe_twice(server: Child, probe: Any) -> None:
    """Warm up (good requests, then one round of the probe), take the baseline, probe again,
    and check the service ends well: a second round costs no more than the first."""
    await warm_up(server, 10)
    await probe()
    for _ in range(5):
        await good_request(server.port)
    baseline = server.rss_mb()
    await probe()
    await ends_well(server, baseline)


SHORT_LIVED = {"keepalive_secs": 2, "keepalive_timeout_secs": 2, "max_age_secs": 4}
"""Connection lifetimes small enough for a test: the same options as the defaults."""
SHORT_LIVED["age_grace_secs"] = 2


async def test_the_default_stream_limit_is_advertised_and_a_stream_past_it_refused() -> None:
    with child() as server:
        async with connected(server.port) as peer:
            await peer.until(lambda: bool(peer.of(h2.events.RemoteSettingsChanged)))
            advertised = peer.of(h2.events.RemoteSettingsChanged)[0].changed_settings
            assert advertised[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS].new_value == 1000
            assert advertised[h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE].new_value == 16384
    with child({"max_concurrent_streams": 50}) as server:

        async def past_the_limit() -> None:
            async with connected(server.port) as peer:
                await peer.until(lambda: bool(peer.of(h2.events.RemoteSettingsChanged)))
                peer.ignore_stream_limit()
                for _ in range(80):
                    peer.open()
                await peer.flush()
                await peer.until(lambda: len(peer.of(h2.events.StreamReset)) >= 30)
                await peer.read(0.5)  # and no more than those
                refused = peer.of(h2.events.StreamReset)
                assert len(refused) == 30
                assert {e.error_code for e in refused} == {h2.errors.ErrorCodes.REFUSED_STREAM}
                assert not peer.of(h2.events.ConnectionTerminated)
                await good_request(server.port)  # meanwhile, on another connection

        await probe_twice(server, past_the_limit)


async def test_rapid_reset_leaves_good_requests_served() -> None:
    """grpcio has no reset budget (no GOAWAY ENHANCE_YOUR_CALM): what holds is that good
    requests on Envoy's own connection are served throughout, and nothing is left after."""
    with child() as server:

        async def flood() -> None:
            async with (
                grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
                connected(server.port) as peer,
            ):
                stub = ep_grpc.ExternalProcessorStub(channel)
                end, served = time.monotonic() + 2.0, 0
                while time.monotonic() < end:
                    for _ in range(50):
                        sid = peer.open()
                        peer.send(sid, processing_request(request_headers()))
                        peer.h2.reset_stream(sid)
                    await peer.flush()
                    assert await peer.read(0.001)
                    call = stub.Process(iter([request_headers(), request_body(body())]), timeout=10)
                    served += len([a async for a in call]) == 2
                assert served > 0

        await probe_twice(server, flood)


@pytest.mark.parametrize("stall", ["zero window", "no socket reads"])
async def test_a_peer_that_stops_reading_is_cut_off(stall: str) -> None:
    """Large body mutations pending for a peer that reads nothing: the connection goes at its
    age limit (or its keepalive for a socket nobody reads), its memory with it."""
    with child(SHORT_LIVED) as server:

        async def stalled() -> None:
            window = h2.settings.SettingCodes.INITIAL_WINDOW_SIZE
            fds_before = server.open_fds()
            peer = await Peer.connect(server.port, {window: 0} if stall == "zero window" else None)
            try:
                for _ in range(40):
                    await send_routed(peer, 1 << 20)
                if stall == "zero window":
                    assert await peer.closed_within(30)
                else:
                    await closed_unread(server, fds_before, 30)
            finally:
                peer.close()

        await probe_twice(server, stalled)


async def closed_unread(server: Child, fds_before: int, secs: float) -> None:
    """Wait, reading and writing nothing, until the server has closed the connection: its
    descriptors are back to what they were before the peer came."""
    end = time.monotonic() + secs
    while server.open_fds() > fds_before:
        assert time.monotonic() < end, f"connection still open after {secs} s"
        await asyncio.sleep(0.5)


async def test_lying_length_prefixes_are_bounded_by_the_connection_age() -> None:
    """Messages that claim 4 MiB and send less, then silence: grpcio buffers them (no
    per-connection byte bound); the connection's age limit ends it."""
    with child(SHORT_LIVED) as server:

        async def lying() -> None:
            async with connected(server.port) as peer:
                await peer.read(0.3)
                for _ in range(20):
                    sid = peer.open()
                    peer.send(sid, grpc_message(b"\x0a" * (1 << 20), claimed=4 << 20))
                    await peer.flush()
                    await peer.read(0.05)
                assert await peer.closed_within(30)

        await probe_twice(server, lying)


async def test_silent_and_half_open_connections_are_closed() -> None:
    with child({"handshake_secs": 1, "idle_secs": 2}) as server:

        async def silent() -> None:
            for opening in (b"", b"PRI * HTTP/2.0\r\n"):  # nothing; half a preface
                reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
                writer.write(opening)
                await asyncio.wait_for(reader.read(), 20)  # EOF: closed by the server
                writer.close()
            async with connected(server.port) as peer:  # a preface, then no stream
                assert await peer.closed_within(20)

        await probe_twice(server, silent)


async def test_idle_connections_at_the_fd_limit_leave_envoys_connection_serving() -> None:
    """1,100 connections that say nothing, at a 1024 open-file limit: the server takes 512
    (half its limit) and closes the rest at once, quietly; Envoy's connection still serves."""
    with child(nofile=1024) as server:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = ep_grpc.ExternalProcessorStub(channel)

            async def envoy_request() -> None:
                requests = [request_headers(), request_body(body()), response_headers(200)]
                answers = [a async for a in stub.Process(iter(requests), timeout=10)]
                assert len(answers) == 3

            async def idle_flood() -> None:
                await envoy_request()
                held = []
                for _ in range(1100):
                    sock = socket.socket()
                    sock.setblocking(False)
                    with contextlib.suppress(BlockingIOError):
                        sock.connect(("127.0.0.1", server.port))
                    held.append(sock)
                try:
                    await asyncio.sleep(1.0)
                    assert server.open_fds() < 1024 * 0.6
                    for _ in range(20):
                        await envoy_request()
                finally:
                    for sock in held:
                        sock.close()

            await probe_twice(server, idle_flood)


async def test_oversized_metadata_is_refused_and_the_connection_serves_on() -> None:
    with child() as server:

        async def header_flood() -> None:
            async with connected(server.port) as peer:
                await peer.read(0.3)
                for i in range(20):
                    sid = peer.open([(f"x-junk-{i}-{j}".encode(), b"v" * 1000) for j in range(40)])
                    await peer.flush()
                    await peer.until_ended(sid, 10)  # RESOURCE_EXHAUSTED, this stream only
                await good_request(server.port)

        await probe_twice(server, header_flood)


H2LOAD = shutil.which("h2load")


@pytest.mark.skipif(H2LOAD is None, reason="h2load (Debian nghttp2-client) is not installed")
async def test_volume_with_h2load(tmp_path: Path) -> None:
    """5,000 whole ext_proc streams (headers, body, response headers) from h2load, three
    times: every one answered in full, memory flat, nothing left."""
    requests = [request_headers(), request_body(body()), response_headers(200)]
    payload = tmp_path / "stream.bin"
    payload.write_bytes(b"".join(processing_request(r) for r in requests))
    with child() as server:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            call = ep_grpc.ExternalProcessorStub(channel).Process(iter(requests), timeout=10)
            answered = sum([len(grpc_message(a.SerializeToString())) async for a in call])
        url = f"http://127.0.0.1:{server.port}{PROCESS.decode()}"
        command = [H2LOAD or "h2load", "-n", "5000", "-c", "4", "-m", "20", "-d", str(payload)]
        command += ["-H", "content-type: application/grpc", "-H", "te: trailers", url]

        async def volume() -> None:
            done = await asyncio.to_thread(
                subprocess.run, command, capture_output=True, text=True, timeout=120
            )
            assert "5000 succeeded, 0 failed, 0 errored, 0 timeout" in done.stdout, done.stdout
            data = re.search(
                r"headers \(space savings [\d.]+%\), (?:[\d.]+\w+) \((\d+)\) data", done.stdout
            )
            assert data is not None, done.stdout
            assert int(data.group(1)) == 5000 * answered  # every stream got its three answers

        await probe_twice(server, volume)


def frame(kind: int, flags: int, sid: int, payload: bytes) -> bytes:
    """One raw HTTP/2 frame, for what the h2 library refuses to send."""
    return struct.pack(">I", len(payload))[1:] + struct.pack(">BBI", kind, flags, sid) + payload


HEADERS_FRAME, CONTINUATION_FRAME = 0x1, 0x9
_FIELD = b"\x00\x03x-a\x7f\xe9\x06" + b"v" * 1000
"""An HPACK literal header field, 1,000-byte value (length 1000 as a 7-bit prefixed int)."""


async def test_garbage_floods_and_bad_messages_end_their_stream_or_connection_only() -> None:
    """A CONTINUATION flood, a garbage preface, a compressed flag without an encoding, and
    Health/Watch streams sent two messages: each ends where it should, the service serves."""
    with child() as server:

        async def garbage() -> None:
            async with connected(server.port) as peer:  # ~3 MB of headers that never end
                await peer.read(0.3)
                peer.writer.write(frame(HEADERS_FRAME, 0, 1, b"\x83"))
                for _ in range(200):
                    peer.writer.write(frame(CONTINUATION_FRAME, 0, 1, _FIELD * 16))
                with contextlib.suppress(ConnectionError):
                    await peer.writer.drain()
                assert await peer.closed_within(10)
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(range(256)) * 64)
            await asyncio.wait_for(reader.read(), 10)  # EOF: closed by the server
            writer.close()
            async with connected(server.port) as peer:
                await peer.read(0.3)
                sid = peer.open()
                peer.send(sid, grpc_message(b"\x0a\x00", compressed=True), end=True)
                await peer.flush()
                await peer.until_ended(sid, 10)
                for _ in range(50):  # Health/Watch: two messages, then the client leaves
                    watch = peer.h2.get_next_available_stream_id()
                    peer.h2.send_headers(
                        watch,
                        [
                            (b":method", b"POST"),
                            (b":scheme", b"http"),
                            (b":path", b"/grpc.health.v1.Health/Watch"),
                            (b":authority", b"localhost"),
                            (b"content-type", b"application/grpc"),
                            (b"te", b"trailers"),
                        ],
                    )
                    peer.send(watch, grpc_message(b"") * 2, end=True)
                    peer.h2.reset_stream(watch)
                await peer.flush()
                assert await peer.read(0.5)
            await good_request(server.port)

        await probe_twice(server, garbage)


async def test_a_ping_flood_gets_goaway_enhance_your_calm() -> None:
    with child() as server:

        async def pings() -> None:
            async with connected(server.port) as peer:
                await peer.read(0.3)
                for _ in range(20):
                    if peer.h2.state_machine.state == h2.connection.ConnectionState.CLOSED:
                        break
                    peer.h2.ping(b"12345678")
                    await peer.flush()
                    await peer.read(0.1)
                await peer.until(lambda: bool(peer.of(h2.events.ConnectionTerminated)))
                ends = peer.of(h2.events.ConnectionTerminated)
                assert [e.error_code for e in ends] == [h2.errors.ErrorCodes.ENHANCE_YOUR_CALM]

        await probe_twice(server, pings)
