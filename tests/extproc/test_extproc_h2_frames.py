"""The `h2` and `frames` transports' receive path: gRPC messages cut anywhere by DATA frames
arrive whole and in order, and what a large body costs per byte received stays the transport's
own work.

Each test serves `H2Server` in process on a loopback port and drives it with `Peer`, which
sends DATA frames exactly where a test cuts them.
"""

from __future__ import annotations

import asyncio
import random
import sys
from collections.abc import AsyncIterator, Callable, Sequence

import h2.events
import hyperframe.frame
import pytest

from hostile_peers import HOST, Peer, grpc_message, status_of
from switchyard_mw._protos.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from switchyard_mw.extproc.h2_transport import ENGINES, Engine, H2Server

pytestmark = pytest.mark.integration

UNCHANGED = ep.ProcessingResponse(request_body=ep.BodyResponse())


class Echo:
    """Answers each message with its body as a body mutation: what arrived, byte for byte."""

    def answer(self, request: ep.ProcessingRequest) -> ep.ProcessingResponse:
        mutation = ep.BodyMutation(body=request.request_body.body)
        common = ep.CommonResponse(body_mutation=mutation)
        return ep.ProcessingResponse(request_body=ep.BodyResponse(response=common))


class Unchanged:
    """Answers each message with a few bytes, whatever its size."""

    def answer(self, request: ep.ProcessingRequest) -> ep.ProcessingResponse:
        return UNCHANGED


@pytest.fixture(params=ENGINES)
async def serve(
    request: pytest.FixtureRequest,
) -> AsyncIterator[Callable[[Callable[[], object]], H2Server]]:
    servers: list[H2Server] = []
    engine: Engine = request.param

    async def start(handler: Callable[[], object]) -> H2Server:
        server = H2Server(lambda _: handler(), lambda _: None, services=(), engine=engine)  # type: ignore[arg-type,return-value]
        await server.listen(f"{HOST}:0")
        servers.append(server)
        return server

    yield start  # type: ignore[misc]
    for server in servers:
        await server.stop(0)


def answers_of(peer: Peer, sid: int) -> list[ep.ProcessingResponse]:
    """The gRPC messages the server sent on `sid`, parsed."""
    data = b"".join(
        e.data or b""
        for e in peer.events
        if isinstance(e, h2.events.DataReceived) and e.stream_id == sid
    )
    answers = []
    while data:
        size = int.from_bytes(data[1:5], "big")
        answers.append(ep.ProcessingResponse.FromString(data[5 : 5 + size]))
        data = data[5 + size :]
    return answers


def cut(data: bytes, sizes: Sequence[int]) -> list[bytes]:
    """`data` in pieces of `sizes` (cycled), the last piece what is left."""
    pieces, at, i = [], 0, 0
    while at < len(data):
        size = sizes[i % len(sizes)]
        pieces.append(data[at : at + size])
        at += size
        i += 1
    return pieces


BODIES = [b"", b"a", b"x" * 300, bytes(range(256)) * 200, b"", b"tail"]
"""Empty, tiny, small, one over several frames (51 KB), then small again."""
CUTS = {
    "byte-by-byte-then-1k": [1] * 16 + [1024],
    "prefix-split-2-3": [2, 3, 7, 5, 1, 4],
    "all-in-large-frames": [16384],
    "random": random.Random(26).choices(range(1, 40_000), k=50),
}


@pytest.mark.parametrize("sizes", list(CUTS.values()), ids=list(CUTS))
async def test_messages_cut_anywhere_by_frames_arrive_whole_and_in_order(
    serve: Callable[[Callable[[], object]], asyncio.Future[H2Server]], sizes: list[int]
) -> None:
    """Length prefixes split over frames, several messages in one frame, an empty message, one
    message over many frames: each answer echoes exactly the body sent, in order."""
    server = await serve(Echo)
    assert server.port is not None
    peer = await Peer.connect(server.port)
    sid = peer.open()
    messages = [
        ep.ProcessingRequest(request_body=ep.HttpBody(body=body)).SerializeToString()
        for body in BODIES
    ]
    stream = b"".join(grpc_message(m) for m in messages)
    for piece in cut(stream, sizes):
        await peer.send(sid, piece)
    await peer.send(sid, b"", end=True)
    assert await peer.until(lambda e: status_of(peer, sid) is not None)
    assert status_of(peer, sid) == 0, peer.trailers(sid)
    echoed = [a.request_body.response.body_mutation.body for a in answers_of(peer, sid)]
    assert echoed == BODIES
    peer.close()


async def test_a_large_body_is_not_hex_dumped(
    serve: Callable[[Callable[[], object]], asyncio.Future[H2Server]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """h2 formats every frame it receives for a trace log (`repr(frame)`, logging on or off),
    and a DATA frame's repr hex-dumps its whole payload: three passes over every byte of a
    body, the largest per-byte cost the transport had. The server's frames must not."""
    dumped: list[int] = []
    hexlify = hyperframe.frame.binascii.hexlify

    def counting(data: bytes, *args: object) -> bytes:
        dumped.append(len(data))
        return hexlify(data, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(hyperframe.frame.binascii, "hexlify", counting)
    server = await serve(Unchanged)
    assert server.port is not None
    peer = await Peer.connect(server.port)
    sid = peer.open()
    body = ep.ProcessingRequest(request_body=ep.HttpBody(body=b"x" * (1 << 20)))
    await peer.send(sid, grpc_message(body.SerializeToString()), end=True)
    assert await peer.until(lambda e: status_of(peer, sid) is not None)
    assert status_of(peer, sid) == 0
    assert len(answers_of(peer, sid)) == 1
    # The peer's own h2 dumps the few bytes it receives; the server's 1 MB goes undumped.
    assert sum(dumped) < 4096, f"{sum(dumped)} bytes hex-dumped in {len(dumped)} frames"
    peer.close()


async def test_tiny_frames_cost_the_stream_about_what_they_carry(
    serve: Callable[[Callable[[], object]], asyncio.Future[H2Server]],
) -> None:
    """A peer that sends a message a byte per DATA frame must not make the stream hold an
    object per byte (~40 bytes each, where the buffer bounds count one)."""
    server = await serve(Unchanged)
    assert server.port is not None
    peer = await Peer.connect(server.port)
    sid = peer.open()
    message = grpc_message(b"x" * 100_000)
    for at in range(0, 20_000, 1000):
        for i in range(at, at + 1000):
            peer.h2.send_data(sid, message[i : i + 1])
        await peer.flush()
    for _ in range(200):  # until the server has read all 20,000 frames
        streams = [s for c in server.connections for s in c.streams.values()]
        if streams and streams[0].size == 20_000:
            break
        await asyncio.sleep(0.02)
    (stream,) = streams
    assert stream.size == 20_000
    assert sum(sys.getsizeof(part) for part in stream.parts) < 2 * stream.size
    peer.close()
