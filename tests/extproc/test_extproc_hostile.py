"""The `h2` and `frames` transports against hostile peers: every bound a peer could push holds,
and after each probe good requests are served in their usual time, memory is back, nothing is
left. Every test runs on both HTTP/2 engines (the `engine` fixture).

Each test runs the server in a child process (`hostile_peers.Served`) with small limits so
that the probes stay short; `test_the_defaults_are_sane` checks the real defaults.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import h2.errors
import h2.events
import httpx
import pytest
from grpc_health.v1 import health_pb2
from h2.frame_buffer import FrameBuffer
from hyperframe.frame import DataFrame, HeadersFrame

import hostile_peers
from envoy_rig import StartRig
from hostile_peers import (
    CHECK,
    CONFIG,
    HOST,
    PROCESS,
    WATCH,
    Peer,
    Served,
    body_message,
    chat_body,
    goaway,
    good_requests,
    grpc_message,
    h2load,
    headers_message,
    status_of,
    within_normal_latency,
)
from switchyard_mw._protos.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from switchyard_mw.accounts import build_accounts
from switchyard_mw.config import parse_config
from switchyard_mw.extproc import Policies, start_server
from switchyard_mw.extproc.h2_transport import (
    DEFAULT_MESSAGE_BYTES,
    ENGINES,
    Engine,
    H2Limits,
    H2Server,
)
from switchyard_mw.testing import MockProvider

pytestmark = pytest.mark.integration

MB = 1 << 20


def envoy_config(mock_url: str) -> str:
    return f"""
[llm_clients.key-a]
base_url = "{mock_url}"
api_key_env = "KEY_A"
models = ["claude-opus-5"]
envoy_cluster = "mock"
"""


SMALL = {
    "preface_secs": 0.5,
    "idle_secs": 0.5,
    "message_secs": 0.5,
    "write_stall_secs": 0.5,
    "max_streams": 50,
    "resets_per_sec": 50.0,
    "reset_burst": 100,
}
"""Limits small enough that every probe meets them within a second."""
BUFFERS = {
    "stream_buffer_bytes": 4 * MB,
    "connection_buffer_bytes": 8 * MB,
    "process_buffer_bytes": 12 * MB,
}


class Probe:
    """A served child with its warm-up figures; `finish()` is every test's common ending."""

    def __init__(self, served: Served) -> None:
        self.served = served
        self.baseline: list[float] = []
        self.rss = 0

    async def warm_up(self) -> None:
        await good_requests(self.served.port, 20)
        self.baseline = await good_requests(self.served.port, 10)
        self.rss = (await self.served.astats())["rss"]

    async def finish(self) -> dict[str, int]:
        """Nothing left, good requests served as fast as before, memory back within 20%."""
        stats = await self.served.settled(streams=0, flights=0, probes=0, watchers=0, held=0)
        latencies = await good_requests(self.served.port, 10)
        assert within_normal_latency(latencies, self.baseline), (latencies, self.baseline)
        stats = await self.served.settled(streams=0, flights=0, probes=0, watchers=0, held=0)
        assert stats["rss"] <= 1.2 * self.rss, (stats["rss"], self.rss)
        return stats


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest) -> Engine:
    """The HTTP/2 engine under test: `h2`'s state machine or `frames`."""
    param: Engine = request.param
    return param


@pytest.fixture
def serve(tmp_path: Path, engine: Engine) -> Iterator[Callable[..., Served]]:
    started: list[Served] = []

    def start(**options: Any) -> Served:
        limits = {**SMALL, **options.pop("limits", {})}
        served = Served(tmp_path, transport=engine, limits=limits, **options)
        started.append(served)
        return served

    yield start
    for served in started:
        served.stop()


@pytest.fixture
async def probe(serve: Callable[..., Served]) -> AsyncIterator[Probe]:
    probe = Probe(serve(limits=BUFFERS, max_message_bytes=2 * MB))
    await probe.warm_up()
    return probe


def refused(event: h2.events.Event) -> bool:
    return (
        isinstance(event, h2.events.StreamReset)
        and event.error_code == h2.errors.ErrorCodes.REFUSED_STREAM
    )


def terminated(event: h2.events.Event) -> bool:
    return isinstance(event, h2.events.ConnectionTerminated)


# -- rapid reset, concurrency ---------------------------------------------------------------------


async def test_rapid_reset_gets_goaway_enhance_your_calm(probe: Probe) -> None:
    peer = await Peer.connect(probe.served.port)
    sent = 0
    for _ in range(40):  # up to 2000 streams opened and reset at once, 50 a write
        for _ in range(50):
            peer.reset(peer.open())
            sent += 1
        if not await peer.flush(2):
            break
        await peer.receive(0.001)
        if goaway(peer) or peer.eof:
            break
    event = await peer.until(terminated)
    assert isinstance(event, h2.events.ConnectionTerminated), (sent, peer.events[-3:])
    assert event.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
    assert await peer.closed_by_server()
    await probe.finish()
    assert probe.served.log().count("ENHANCE_YOUR_CALM") == 1


async def test_resets_within_the_budget_are_served_on(probe: Probe) -> None:
    peer = await Peer.connect(probe.served.port)
    sid = peer.open()  # open throughout: the connection is not idle
    await peer.send(sid, grpc_message(headers_message()))
    for _ in range(10):  # 200 resets, twice the burst, but no faster than 50/s earns back
        for _ in range(20):
            peer.reset(peer.open())
        await peer.flush()
        await peer.receive(0.45)
    await peer.send(sid, b"", end=True)
    assert await peer.until(lambda e: status_of(peer, sid) is not None)
    assert status_of(peer, sid) == 0
    assert goaway(peer) is None
    peer.close()
    await probe.finish()


async def test_streams_reset_once_answered_are_not_a_rapid_reset(probe: Probe) -> None:
    # What Envoy does with every ext_proc stream: once it has the last answer it needs, it
    # resets the stream rather than half-closing it. Three times the burst, well within the
    # time the budget would earn back: none of them cut work, none counts.
    peer = await Peer.connect(probe.served.port)
    for _ in range(10):
        sids = [peer.open() for _ in range(30)]
        for sid in sids:
            await peer.send(sid, grpc_message(headers_message(f"rid-{sid}")))
        for sid in sids:
            answered = await peer.until(
                lambda e, sid=sid: isinstance(e, h2.events.DataReceived) and e.stream_id == sid
            )
            assert answered is not None, (sid, peer.events[-3:])
        for sid in sids:
            peer.reset(sid)
        await peer.flush()
    last = peer.open()
    await peer.send(last, grpc_message(headers_message("rid-last")), end=True)
    assert await peer.until(lambda e: status_of(peer, last) is not None)
    assert status_of(peer, last) == 0
    assert goaway(peer) is None
    peer.close()
    await probe.finish()
    assert "ENHANCE_YOUR_CALM" not in probe.served.log()


async def test_envoy_under_steady_traffic_is_never_told_to_calm_down(
    caplog: pytest.LogCaptureFixture, engine: Engine, mock_server: tuple[MockProvider, str]
) -> None:
    # Envoy resets each ext_proc stream once answered. With a budget of 20 resets (and one a
    # second earned back), 120 requests through one Envoy connection would trip it 5 times
    # if those resets counted, and each GOAWAY fails the requests then in flight.
    mock, mock_url = mock_server
    start_rig = StartRig(mock, mock_url, engine)
    limits = H2Limits(resets_per_sec=1.0, reset_burst=20)
    async with start_rig(envoy_config, {"KEY_A": "ka"}, h2_limits=limits) as rig:
        statuses = await envoy_requests(rig.envoy_url, 120, 6)
    assert statuses == [200] * 120
    assert "ENHANCE_YOUR_CALM" not in caplog.text


async def envoy_requests(url: str, count: int, concurrency: int) -> list[int]:
    """The statuses of `count` requests, `concurrency` at a time."""
    body = chat_body("claude-opus-5")
    headers = {"content-type": "application/json", "x-api-key": "caller"}
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:

        async def some(n: int) -> list[int]:
            return [
                (await client.post("/v1/messages", content=body, headers=headers)).status_code
                for _ in range(n)
            ]

        batches = await asyncio.gather(*(some(count // concurrency) for _ in range(concurrency)))
    return [status for batch in batches for status in batch]


async def test_a_reset_while_the_answer_is_being_made_counts(probe: Probe) -> None:
    # The other side of the rule above: a stream reset with a message not yet answered cut
    # the server's work short; a peer doing that past the budget is a rapid reset.
    peer = await Peer.connect(probe.served.port)
    for _ in range(40):  # up to 2000, 50 a write: headers and a message, then the reset
        for _ in range(50):
            sid = peer.open()
            peer.h2.send_data(sid, grpc_message(headers_message(f"rid-{sid}")))
            peer.reset(sid)
        if not await peer.flush(2):
            break
        await peer.receive(0.001)
        if goaway(peer) or peer.eof:
            break
    event = await peer.until(terminated)
    assert isinstance(event, h2.events.ConnectionTerminated), peer.events[-3:]
    assert event.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
    await probe.finish()


PROCESS_RESETS = {"process_resets_per_sec": 20.0, "process_reset_burst": 200}
"""A process-wide budget of two connections' bursts (`SMALL`), earned back slowly."""


async def reconnecting_attacker(port: int, secs: float) -> tuple[int, int]:
    """Streams opened and reset at once, 50 a write, on a new connection after each GOAWAY,
    for `secs`: (connections used, streams the server accepted on them in all, read from each
    GOAWAY's last stream id, or every stream sent when none came)."""
    connections = accepted = 0
    deadline = time.monotonic() + secs
    while time.monotonic() < deadline:
        peer = await Peer.connect(port)
        connections += 1
        opened = 0
        while time.monotonic() < deadline:
            for _ in range(50):
                peer.reset(peer.open())
                opened += 1
            if not await peer.flush(2):
                break
            await peer.receive(0.001)
            if goaway(peer) or peer.eof:
                break
        end = goaway(peer) or await peer.until(terminated, 2)
        if isinstance(end, h2.events.ConnectionTerminated) and end.last_stream_id is not None:
            accepted += (end.last_stream_id + 1) // 2  # client streams are odd: 1, 3, 5, ...
        else:
            accepted += opened
        peer.close()
    return connections, accepted


async def good_requests_elsewhere(port: int, count: int, *, after_secs: float) -> list[float]:
    """`good_requests` from a child process, `after_secs` after it has started: the
    attacker's loop in this process does not slow them, the server alone may."""
    code = (
        "import asyncio, json, sys, time\n"
        "from hostile_peers import good_requests\n"
        "time.sleep(float(sys.argv[3]))\n"
        "print(json.dumps(asyncio.run(good_requests(int(sys.argv[1]), int(sys.argv[2])))))\n"
    )
    path = os.pathsep.join(
        [str(Path(hostile_peers.__file__).parent), os.environ.get("PYTHONPATH", "")]
    )
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        code,
        str(port),
        str(count),
        str(after_secs),
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": path},
    )
    out, _ = await asyncio.wait_for(child.communicate(), 60)
    assert child.returncode == 0
    latencies: list[float] = json.loads(out)
    return latencies


async def test_a_peer_that_reconnects_gets_no_fresh_burst(serve: Callable[..., Served]) -> None:
    # Each connection may cut 100 streams short (SMALL); the process 200, then 20 a second.
    # Reconnecting after every GOAWAY, the attacker gets the process's budget, not 100 more
    # per connection, while good requests on their own connections keep their latency.
    probe = Probe(serve(limits=BUFFERS | PROCESS_RESETS, max_message_bytes=2 * MB))
    await probe.warm_up()
    # Once the budget is spent (well within the first second), from a process of their own.
    good = asyncio.create_task(good_requests_elsewhere(probe.served.port, 10, after_secs=1.0))
    started = time.monotonic()
    connections, accepted = await reconnecting_attacker(probe.served.port, 4.0)
    elapsed = time.monotonic() - started
    latencies = await good
    # Past the budget each connection gets one stream (its first reset trips the budget).
    bound = 200 + 20 * elapsed + connections
    assert accepted <= bound, (accepted, bound, connections)
    # Without the process's budget, each connection but the last would have had its own 100.
    assert connections >= 5, connections
    assert accepted < 100 * (connections - 1), (accepted, connections)
    assert within_normal_latency(latencies, probe.baseline), (latencies, probe.baseline)
    await probe.finish()
    log = probe.served.log()
    assert 1 <= log.count("across the process") <= 2, log[-3000:]  # one line per minute
    assert log.count("ENHANCE_YOUR_CALM") < 10, log[-3000:]  # not one per connection


async def test_a_connection_asked_to_calm_down_by_the_process_budget_finishes_its_streams(
    serve: Callable[..., Served],
) -> None:
    # The process's budget is spent by another peer; this one (Envoy, say) then cuts one
    # stream short. It is asked to go (GOAWAY ENHANCE_YOUR_CALM), refused new streams, and its
    # stream in flight is still answered.
    limits = BUFFERS | {
        "reset_burst": 1000,
        "process_reset_burst": 50,
        "process_resets_per_sec": 1.0,
    }
    probe = Probe(serve(limits=limits, max_message_bytes=2 * MB))
    await probe.warm_up()
    innocent = await Peer.connect(probe.served.port)
    in_flight = innocent.open()
    await innocent.send(in_flight, grpc_message(headers_message("rid-in-flight")))
    assert await innocent.until(
        lambda e: isinstance(e, h2.events.DataReceived) and e.stream_id == in_flight
    )
    attacker = await Peer.connect(probe.served.port)
    for _ in range(60):
        attacker.reset(attacker.open())
    await attacker.flush()
    event = await attacker.until(terminated)
    assert isinstance(event, h2.events.ConnectionTerminated), attacker.events[-3:]
    assert event.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
    cut = innocent.open()
    await innocent.flush()
    innocent.reset(cut)  # nothing answered on it: it counts, and the process has no budget
    await innocent.flush()
    calm = await innocent.until(terminated)
    assert isinstance(calm, h2.events.ConnectionTerminated)
    assert calm.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
    assert calm.last_stream_id == cut
    # The client's h2 closes its side on a GOAWAY (python-hyper/h2#1181): frames by hand.
    end = DataFrame(in_flight)
    end.flags.add("END_STREAM")
    innocent.writer.write(end.serialize())
    trailers = await trailers_by_hand(innocent, in_flight)
    assert trailers is not None
    assert trailers[b"grpc-status"] == b"0"
    assert await innocent.closed_by_server()  # once its last stream is done
    await probe.finish()


async def trailers_by_hand(peer: Peer, sid: int) -> dict[bytes, bytes] | None:
    """The trailers of stream `sid`, read frame by frame past the peer's closed h2."""
    frames = FrameBuffer(server=False)
    frames.max_frame_size = 1 << 14
    deadline = time.monotonic() + 10
    while (left := deadline - time.monotonic()) > 0:
        data = await asyncio.wait_for(peer.reader.read(1 << 16), left)
        if not data:
            return None
        frames.add_data(data)
        for frame in frames:
            if isinstance(frame, HeadersFrame) and frame.stream_id == sid:
                if "END_STREAM" in frame.flags:
                    return dict(peer.h2.decoder.decode(frame.data, raw=True))
                peer.h2.decoder.decode(frame.data, raw=True)  # keeps the HPACK table in step
    return None


async def test_a_stream_over_the_advertised_limit_is_refused_alone(probe: Probe) -> None:
    peer = await Peer.connect(probe.served.port)
    settings = await peer.until(lambda e: isinstance(e, h2.events.RemoteSettingsChanged))
    assert isinstance(settings, h2.events.RemoteSettingsChanged)
    advertised = settings.changed_settings[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS]
    assert advertised.new_value == 50
    sids = [peer.open() for _ in range(50)]
    await peer.flush()
    await peer.receive(0.2)
    # The server's limit as the peer knows it would stop h2 from opening one more: lift it.
    peer.h2.remote_settings = h2.settings.Settings(client=False)
    extra = peer.open()
    await peer.flush()
    event = await peer.until(refused)
    assert isinstance(event, h2.events.StreamReset)
    assert event.stream_id == extra
    for sid in sids:  # the other 50 live on and are answered
        await peer.send(sid, grpc_message(headers_message()), end=True)
    assert await peer.until(lambda e: all(status_of(peer, s) is not None for s in sids))
    assert [status_of(peer, s) for s in sids] == [0] * 50
    assert goaway(peer) is None
    peer.close()
    await probe.finish()


# -- buffers: a peer that stops reading, lying length prefixes ----------------------------------


async def send_large_mutations(peer: Peer, streams: int, size: int) -> int:
    """Open `streams` streams, each asking for a rewritten body of `size` bytes; how many the
    server took before it stopped reading."""
    body = grpc_message(body_message(chat_body("m-base", size)))
    for i in range(streams):
        sid = peer.open()
        peer.h2.send_data(sid, grpc_message(headers_message(f"big-{i}")))
        await peer.flush(1)
        for offset in range(0, len(body), 16384):
            chunk = body[offset : offset + 16384]
            if peer.h2.local_flow_control_window(sid) < len(chunk):
                return i
            peer.h2.send_data(sid, chunk)
        if not await peer.flush(1):
            return i
    return streams


@pytest.mark.parametrize("how", ["zero_window", "no_reads"])
async def test_a_peer_that_stops_reading_holds_bounded_memory(probe: Probe, how: str) -> None:
    window = 0 if how == "zero_window" else (1 << 31) - 1
    peer = await Peer.connect(probe.served.port, window=window)
    await peer.receive(0.2)  # the server's settings and windows; then it stops reading,
    peer.acknowledge = False  # or reads but never opens its own window
    taken = await send_large_mutations(peer, 60, int(1.5 * MB))  # 90 MB of answers asked
    during = await probe.served.astats()
    assert during["held"] <= BUFFERS["process_buffer_bytes"]
    assert during["rss"] - probe.rss < 60 * MB, (during, taken)
    # Stalled for write_stall_secs: the connection is closed and everything let go.
    await probe.served.settled(connections=0)
    peer.close()
    await probe.finish()


async def test_lying_length_prefixes_then_silence_time_out(probe: Probe) -> None:
    peer = await Peer.connect(probe.served.port)
    sids = []
    for _ in range(20):  # each claims 1.4 MB more than the 0.5 MB it sends
        sid = peer.open()
        sids.append(sid)
        await peer.send(sid, grpc_message(b"\0" * (MB // 2), claimed=int(1.9 * MB)))
    during = await probe.served.astats()
    assert during["held"] <= BUFFERS["process_buffer_bytes"]
    assert during["rss"] - probe.rss < 30 * MB
    # Over the bounds, or silent for message_secs: every stream is failed, none is left.
    assert await peer.until(lambda e: all(status_of(peer, s) is not None for s in sids))
    statuses = {status_of(peer, s) for s in sids}
    assert statuses <= {4, 8}, statuses  # DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED
    assert 4 in statuses
    peer.close()
    await probe.finish()


async def test_a_length_prefix_over_the_message_limit_is_refused(probe: Probe) -> None:
    peer = await Peer.connect(probe.served.port)
    sid = peer.open()
    await peer.send(sid, grpc_message(b"", claimed=(1 << 32) - 1))
    assert await peer.until(lambda e: status_of(peer, sid) is not None)
    assert status_of(peer, sid) == 8
    peer.close()
    await probe.finish()


async def test_the_compressed_flag_without_an_encoding_is_refused(probe: Probe) -> None:
    peer = await Peer.connect(probe.served.port)
    sid = peer.open()
    await peer.send(sid, grpc_message(headers_message(), compressed=True), end=True)
    assert await peer.until(lambda e: status_of(peer, sid) is not None)
    assert status_of(peer, sid) == 13  # INTERNAL, as grpc-core answers it
    peer.close()
    await probe.finish()


# -- prefaces and idle connections ------------------------------------------------------------


async def test_a_half_sent_preface_is_closed(probe: Probe) -> None:
    reader, writer = await asyncio.open_connection(HOST, probe.served.port)
    writer.write(b"PRI * HTTP/2.0\r\n")
    await writer.drain()
    assert await asyncio.wait_for(reader.read(), 10) is not None  # returns: closed
    writer.close()
    await probe.finish()


async def test_a_silent_connection_is_closed_after_the_idle_timeout(probe: Probe) -> None:
    peer = await Peer.connect(probe.served.port)
    event = await peer.until(terminated, 10)
    assert isinstance(event, h2.events.ConnectionTerminated)
    assert event.error_code == h2.errors.ErrorCodes.NO_ERROR
    assert await peer.closed_by_server()
    await probe.finish()


async def test_a_connection_with_a_stream_open_is_not_idle(probe: Probe) -> None:
    peer = await Peer.connect(probe.served.port)
    sid = peer.open()
    await peer.send(sid, grpc_message(headers_message()))  # Envoy waits on the upstream
    await peer.receive(2.0)  # four idle timeouts
    assert goaway(peer) is None
    assert not peer.eof
    await peer.send(sid, b"", end=True)
    assert await peer.until(lambda e: status_of(peer, sid) is not None)
    assert status_of(peer, sid) == 0
    peer.close()
    await probe.finish()


@pytest.mark.parametrize(
    "garbage",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(64),  # a TLS ClientHello
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes(range(256)) * 8,
        bytes(range(256)) * 64,
    ],
    ids=["http1", "tls", "preface-then-garbage", "random"],
)
async def test_a_garbage_preface_is_closed(probe: Probe, garbage: bytes) -> None:
    reader, writer = await asyncio.open_connection(HOST, probe.served.port)
    writer.write(garbage)
    await writer.drain()
    said = await asyncio.wait_for(reader.read(), 10)  # returns: the server closed it
    assert not said.startswith(b"HTTP/1")
    writer.close()
    await probe.finish()


# -- header blocks ------------------------------------------------------------------------------


async def test_a_continuation_flood_ends_the_connection(probe: Probe) -> None:
    peer = await Peer.connect(probe.served.port)
    await peer.receive(0.2)
    # HEADERS without END_HEADERS, then CONTINUATION frames that never end the block.
    from hyperframe.frame import ContinuationFrame, HeadersFrame

    first = HeadersFrame(1)
    first.data = b"\x82"  # :method GET, indexed
    peer.writer.write(first.serialize())
    for _ in range(200):
        more = ContinuationFrame(1)
        more.data = b"\x00\x01a\x01b" * 2000  # literal a: b, 10 KB a frame
        peer.writer.write(more.serialize())
    with contextlib.suppress(ConnectionError):  # the server may close before it is all sent
        await asyncio.wait_for(peer.writer.drain(), 10)
    assert await peer.closed_by_server()
    await probe.finish()


async def test_a_header_list_over_the_limit_ends_the_connection(probe: Probe) -> None:
    peer = await Peer.connect(probe.served.port)
    big = [(f"x-pad-{i}".encode(), b"v" * 4000) for i in range(40)]  # 160 KB of headers
    peer.open(extra=big)
    await peer.flush()
    event = await peer.until(terminated)
    assert isinstance(event, h2.events.ConnectionTerminated)
    assert await peer.closed_by_server()
    await probe.finish()


async def test_many_header_blocks_on_many_streams_are_bounded(probe: Probe) -> None:
    """Headers just under the list limit on every stream the connection may open."""
    peer = await Peer.connect(probe.served.port)
    pad = [(f"x-pad-{i}".encode(), b"v" * 3000) for i in range(20)]  # 60 KB a stream
    for _ in range(3):
        for _ in range(50):
            peer.open(extra=pad, end=True)
        await peer.flush()
        await peer.receive(0.2)
    peer.close()
    await probe.finish()


# -- connections --------------------------------------------------------------------------------


async def test_idle_connections_at_the_fd_limit_leave_room_for_good_ones(
    serve: Callable[..., Served],
) -> None:
    # 256 descriptors: the cap is 128 connections. 300 idle ones come; the oldest make room.
    served = serve(nofile=256, limits={"idle_secs": 60.0, "preface_secs": 60.0})
    probe = Probe(served)
    await probe.warm_up()
    peers = [await Peer.connect(served.port) for _ in range(300)]
    latencies = await good_requests(served.port, 5)  # served while the flood holds on
    assert within_normal_latency(latencies, probe.baseline), latencies
    stats = await served.astats()
    assert stats["open_connections"] <= 128
    for peer in peers:
        peer.close()
    await probe.finish()
    assert len(served.log()) < 10_000, served.log()[-2000:]


async def test_out_of_descriptors_logs_one_line_per_episode(serve: Callable[..., Served]) -> None:
    served = serve(nofile=256, spare_fds=40, limits={"idle_secs": 60.0, "preface_secs": 60.0})
    probe = Probe(served)
    await probe.warm_up()
    writers = []
    for _ in range(100):  # more than the descriptors left: accept runs out
        _, writer = await asyncio.open_connection(HOST, served.port)
        writers.append(writer)
    await asyncio.sleep(2.5)  # two retries of the accept
    for writer in writers:
        writer.transport.abort()
    await probe.finish()
    log = served.log()
    assert log.count("cannot accept connections") == 1, log[-3000:]
    assert "Traceback" not in log
    assert len(log) < 5_000


# -- health ------------------------------------------------------------------------------------


async def test_health_watch_with_two_messages_leaves_no_watcher(probe: Probe) -> None:
    request = grpc_message(health_pb2.HealthCheckRequest(service="").SerializeToString())
    for _ in range(100):
        peer = await Peer.connect(probe.served.port)
        sid = peer.open(WATCH)
        await peer.send(sid, request + request)
        await peer.receive(0.05)
        peer.close()
    await probe.finish()


async def test_health_check_with_two_messages_answers_once(probe: Probe) -> None:
    request = grpc_message(health_pb2.HealthCheckRequest(service="").SerializeToString())
    peer = await Peer.connect(probe.served.port)
    sid = peer.open(CHECK)
    await peer.send(sid, request + request, end=True)
    assert await peer.until(lambda e: status_of(peer, sid) is not None)
    answers = [e for e in peer.events if isinstance(e, h2.events.DataReceived)]
    assert len(answers) == 1
    assert status_of(peer, sid) == 0
    peer.close()
    await probe.finish()


# -- volume (h2load) ----------------------------------------------------------------------------


async def test_h2load_volume_leaves_nothing_behind(
    serve: Callable[..., Served], tmp_path: Path
) -> None:
    # Timers no shorter than a loaded machine may take to read a connection's first bytes.
    timers = {"preface_secs": 5.0, "idle_secs": 5.0, "message_secs": 5.0}
    probe = Probe(serve(limits=BUFFERS | timers, max_message_bytes=2 * MB))
    await probe.warm_up()
    message = tmp_path / "headers.bin"
    message.write_bytes(grpc_message(headers_message()))
    url = f"http://{HOST}:{probe.served.port}{PROCESS.decode()}"
    out = await h2load(
        [
            "-n",
            "10000",
            "-c",
            "4",
            "-m",
            "50",  # the advertised limit (h2load opens them before it reads the SETTINGS)
            "-d",
            str(message),
            "-H",
            "content-type: application/grpc",
            "-H",
            "te: trailers",
            url,
        ]
    )
    assert "10000 succeeded" in out, (out, probe.served.log()[-3000:])
    assert (await probe.served.astats())["streams"] == 0
    await probe.finish()


# -- the defaults --------------------------------------------------------------------------------


def test_the_defaults_are_sane() -> None:
    limits = H2Limits()
    assert limits.max_message_bytes == DEFAULT_MESSAGE_BYTES
    # A stream holds one message each way; a connection and the process many streams' worth.
    assert limits.stream_buffer_bytes >= 2 * limits.max_message_bytes
    assert limits.connection_buffer_bytes >= 2 * limits.stream_buffer_bytes
    assert limits.process_buffer_bytes >= limits.connection_buffer_bytes
    assert limits.process_buffer_bytes <= 300 << 20  # what a peer may make the process hold
    assert limits.max_streams == 1000  # what Envoy and grpc-go expect of a server
    assert limits.reset_burst >= limits.max_streams  # a whole connection's worth at once
    assert 10 <= limits.resets_per_sec <= 1000
    # The process's: a few connections' worth, and no more than a small share of a core's
    # requests (a counted reset costs about what a request does).
    assert limits.reset_burst <= limits.process_reset_burst <= 4 * limits.reset_burst
    assert limits.resets_per_sec <= limits.process_resets_per_sec <= 1000
    assert limits.preface_secs <= 30
    assert limits.write_stall_secs <= 60
    assert limits.idle_secs >= 60
    assert limits.message_secs >= 10
    assert limits.max_header_list_bytes == 64 << 10
    scaled = H2Limits.for_message_size(100 * MB, max_streams=7)
    assert scaled.stream_buffer_bytes == 200 * MB
    assert scaled.max_streams == 7
    assert limits.tick_secs == 1.0


async def test_the_server_advertises_its_default_limits(engine: Engine) -> None:
    config = parse_config(CONFIG)
    policies = Policies(config, build_accounts(config, {"KEY_A": "ka"}))
    server = await start_server(policies, f"{HOST}:0", transport=engine)
    try:
        assert server.port is not None
        limits = server._stop.__self__.limits  # type: ignore[attr-defined]  # H2Server.stop
        assert limits == H2Limits.for_message_size(config.server.max_body_bytes + MB)
        assert limits.max_message_bytes == DEFAULT_MESSAGE_BYTES
        peer = await Peer.connect(server.port)
        event = await peer.until(lambda e: isinstance(e, h2.events.RemoteSettingsChanged))
        assert isinstance(event, h2.events.RemoteSettingsChanged)
        advertised = {code: c.new_value for code, c in event.changed_settings.items()}
        assert advertised[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS] == 1000
        assert advertised[h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE] == 64 << 10
        peer.close()
    finally:
        await server.stop(0)


async def test_the_connection_cap_leaves_half_the_descriptors() -> None:
    server = H2Server(lambda _: None, lambda _: None, services=())  # type: ignore[arg-type,return-value]
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert server.max_connections == min(1000, soft // 2)


async def test_a_request_with_a_large_mutation_to_a_reading_peer_is_whole(probe: Probe) -> None:
    """The bounds leave a real exchange alone: a 1.5 MB body comes back rewritten, whole."""
    peer = await Peer.connect(probe.served.port)
    sid = peer.open()
    body = chat_body("m-base", int(1.5 * MB))
    await peer.send(sid, grpc_message(headers_message()) + grpc_message(body_message(body)))
    await peer.send(sid, b"", end=True)
    assert await peer.until(lambda e: status_of(peer, sid) is not None)
    assert status_of(peer, sid) == 0
    data = b"".join(e.data for e in peer.events if isinstance(e, h2.events.DataReceived))
    answers = []
    while data:
        size = int.from_bytes(data[1:5], "big")
        answers.append(ep.ProcessingResponse.FromString(data[5 : 5 + size]))
        data = data[5 + size :]
    mutated = answers[1].request_body.response.body_mutation.body
    assert len(mutated) == len(body) - 1  # "m-base" became "m-var"
    assert b'"m-var"' in mutated
    peer.close()
    await probe.finish()


# -- one stream's bounds, with handlers that stand still or echo ----------------------------------


class Stuck:
    """Never answers: what the peer sends next waits in the stream's queue."""

    async def answer(self, request: ep.ProcessingRequest) -> ep.ProcessingResponse:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


class Echo:
    """Answers each body with a body mutation as large."""

    def answer(self, request: ep.ProcessingRequest) -> ep.ProcessingResponse:
        mutation = ep.BodyMutation(body=request.request_body.body)
        common = ep.CommonResponse(body_mutation=mutation)
        return ep.ProcessingResponse(request_body=ep.BodyResponse(response=common))


@pytest.mark.parametrize(
    ("handler", "window"), [(Stuck, None), (Echo, 0)], ids=["queued-messages", "unread-answers"]
)
async def test_one_stream_holds_no_more_than_its_bound(
    handler: Callable[[], Stuck | Echo], window: int | None, engine: Engine
) -> None:
    """Messages queued behind a handler that has not answered (Stuck), or answers a peer
    does not take (Echo, zero window): over 3 MB the stream fails, RESOURCE_EXHAUSTED."""
    ended: list[object] = []
    limits = H2Limits.for_message_size(MB, stream_buffer_bytes=3 * MB, **SMALL)
    server = H2Server(lambda _: handler(), ended.append, services=(), limits=limits, engine=engine)
    await server.listen(f"{HOST}:0")
    try:
        assert server.port is not None
        peer = await Peer.connect(server.port, window=window)
        await peer.receive(0.2)
        sid = peer.open()
        body = ep.ProcessingRequest(request_body=ep.HttpBody(body=b"x" * (MB // 2)))
        message = grpc_message(body.SerializeToString())
        for _ in range(10):  # 5 MB
            await peer.send(sid, message)
            await peer.receive(0.05)
            if status_of(peer, sid) is not None:
                break
        assert await peer.until(lambda e: status_of(peer, sid) is not None)
        assert status_of(peer, sid) == 8, peer.trailers(sid)
        assert b"stream buffers over" in (peer.trailers(sid) or {}).get(b"grpc-message", b"")
        peer.close()
        for _ in range(100):
            if not server.connections and ended:
                break
            await asyncio.sleep(0.02)
        assert server.held == 0
        assert not server.connections
        assert len(ended) == 1  # the handler ended, once
    finally:
        await server.stop(0)
