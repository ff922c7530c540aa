"""The h2 transports run a stream's handler in a task only for a message whose answer takes
waiting: a message its handler answers at once (`answer` returns the answer, not an awaitable)
is answered in the read's own callback, in the stream's context, with no task per message.

Every phase but the request's body (the router) or a retry's headers (upstream) is answered at
once, so a request through Envoy needs one task instead of one per message. Order holds: a
message behind one being awaited waits for it, and is answered by the same task.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from hostile_peers import HOST, Peer, grpc_message, status_of
from switchyard_mw._protos.envoy.config.core.v3 import base_pb2
from switchyard_mw._protos.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from switchyard_mw.extproc.body_envelope import MIN_BYTES
from switchyard_mw.extproc.h2_transport import ENGINES, Engine, H2Server

pytestmark = pytest.mark.integration  # serves on a loopback port

STREAM_VAR: contextvars.ContextVar[str] = contextvars.ContextVar("stream", default="")


def _answer(body: bytes) -> ep.ProcessingResponse:
    mutation = ep.BodyMutation(body=body)
    return ep.ProcessingResponse(
        request_body=ep.BodyResponse(response=ep.CommonResponse(body_mutation=mutation))
    )


class Recorder:
    """Answers each body with itself, at once, unless it is b"wait" (then when `go` is set);
    records, for each message, the task it was asked in (None: the read's callback) and the
    stream's context value, and the task that awaited b"wait"."""

    go: asyncio.Event
    seen: list[tuple[bytes, asyncio.Task[object] | None, str]]
    awaited_in: list[asyncio.Task[object] | None]

    def __init__(self) -> None:
        STREAM_VAR.set("mine")  # set while the handler is made: the stream's context
        self.count = 0

    def answer(
        self, request: ep.ProcessingRequest
    ) -> ep.ProcessingResponse | Awaitable[ep.ProcessingResponse]:
        body = request.request_body.body
        Recorder.seen.append((body, asyncio.current_task(), STREAM_VAR.get()))
        if body == b"wait":
            return self._later(body)
        return _answer(body)

    async def _later(self, body: bytes) -> ep.ProcessingResponse:
        Recorder.awaited_in.append(asyncio.current_task())
        await Recorder.go.wait()
        return _answer(body)


@pytest.fixture(params=ENGINES)
async def server(request: pytest.FixtureRequest) -> AsyncIterator[H2Server]:
    engine: Engine = request.param
    Recorder.go, Recorder.seen, Recorder.awaited_in = asyncio.Event(), [], []
    served = H2Server(lambda _: Recorder(), lambda _: None, services=(), engine=engine)  # type: ignore[arg-type,return-value]
    await served.listen(f"{HOST}:0")
    yield served
    await served.stop(0)


def _message(body: bytes) -> bytes:
    return grpc_message(
        ep.ProcessingRequest(request_body=ep.HttpBody(body=body)).SerializeToString()
    )


def _answers(peer: Peer, sid: int) -> list[bytes]:
    data = b"".join(
        e.data or b""
        for e in peer.events
        if getattr(e, "stream_id", None) == sid and hasattr(e, "data")
    )
    out = []
    while len(data) >= 5:
        size = int.from_bytes(data[1:5], "big")
        if len(data) < 5 + size:
            break  # an answer still arriving
        answer = ep.ProcessingResponse.FromString(data[5 : 5 + size])
        out.append(answer.request_body.response.body_mutation.body)
        data = data[5 + size :]
    return out


async def _answered(peer: Peer, sid: int, count: int) -> None:
    """Until the server has sent `count` answers on `sid` (fails after the peer's wait)."""
    assert await peer.until(lambda _: len(_answers(peer, sid)) >= count), _answers(peer, sid)


async def _until(check: Callable[[], bool]) -> None:
    for _ in range(500):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not within 5 s")


async def test_messages_answered_at_once_take_no_task(server: H2Server) -> None:
    assert server.port is not None
    peer = await Peer.connect(server.port)
    sid = peer.open()
    for count, body in enumerate((b"one", b"two", b"three"), 1):
        await peer.send(sid, _message(body))
        await _answered(peer, sid, count)
    await peer.send(sid, b"", end=True)
    assert await peer.until(lambda _: status_of(peer, sid) is not None)
    assert status_of(peer, sid) == 0
    assert _answers(peer, sid) == [b"one", b"two", b"three"]
    assert [(body, task) for body, task, _ in Recorder.seen] == [
        (b"one", None),
        (b"two", None),
        (b"three", None),
    ]
    assert {value for _, _, value in Recorder.seen} == {"mine"}  # the stream's own context
    peer.close()


async def test_a_message_that_waits_is_answered_in_a_task_and_those_behind_it_wait(
    server: H2Server,
) -> None:
    assert server.port is not None
    peer = await Peer.connect(server.port)
    sid = peer.open()
    await peer.send(sid, _message(b"first"))
    await _answered(peer, sid, 1)
    await peer.send(sid, _message(b"wait") + _message(b"after"))
    await _until(lambda: len(Recorder.seen) == 2)
    await asyncio.sleep(0.05)
    assert _answers(peer, sid) == [b"first"]  # "after" waits behind "wait"
    assert len(Recorder.seen) == 2
    Recorder.go.set()
    await _answered(peer, sid, 3)
    await peer.send(sid, _message(b"last"), end=True)
    assert await peer.until(lambda _: status_of(peer, sid) is not None)
    assert _answers(peer, sid) == [b"first", b"wait", b"after", b"last"]
    # "wait" is asked at once and what it gave awaited in a task, which also answers the
    # message behind it; once that task is done, the next message is answered at once again.
    (waited_in,) = Recorder.awaited_in
    assert waited_in is not None
    assert [task for _, task, _ in Recorder.seen] == [None, None, waited_in, None]
    assert {value for _, _, value in Recorder.seen} == {"mine"}
    peer.close()


class BodyTaker(Recorder):
    """A `TakesBody`: records which of its two ways each message came by; a body that starts
    with b"wait" is answered when `go` is set."""

    ways: list[tuple[str, bytes]]

    def answer(
        self, request: ep.ProcessingRequest
    ) -> ep.ProcessingResponse | Awaitable[ep.ProcessingResponse]:
        BodyTaker.ways.append(("answer", request.request_body.body))
        return self._body(request.request_body.body)

    def answer_body(self, body: bytes) -> ep.ProcessingResponse | Awaitable[ep.ProcessingResponse]:
        assert type(body) is bytes  # the handler's own: not a view of the connection's bytes
        BodyTaker.ways.append(("answer_body", body))
        return self._body(body)

    def _body(self, body: bytes) -> ep.ProcessingResponse | Awaitable[ep.ProcessingResponse]:
        Recorder.seen.append((body, asyncio.current_task(), STREAM_VAR.get()))
        if body.startswith(b"wait"):
            return self._later(body)
        return _answer(body)


@pytest.fixture(params=ENGINES)
async def taker(request: pytest.FixtureRequest) -> AsyncIterator[H2Server]:
    engine: Engine = request.param
    Recorder.go, Recorder.seen, Recorder.awaited_in = asyncio.Event(), [], []
    BodyTaker.ways = []
    served = H2Server(lambda _: BodyTaker(), lambda _: None, services=(), engine=engine)  # type: ignore[arg-type,return-value]
    await served.listen(f"{HOST}:0")
    yield served
    await served.stop(0)


async def test_a_large_request_body_reaches_a_taker_as_its_own_bytes(taker: H2Server) -> None:
    """A large message that is a request body is handed to `answer_body` as the body's bytes
    (in many DATA frames, behind a message that waits, or itself waiting); a small one, and
    any other message (a large body with metadata beside it), to `answer`, parsed."""
    assert taker.port is not None
    peer = await Peer.connect(taker.port)
    sid = peer.open()
    large = bytes(range(256)) * 800  # 200 KB: many DATA frames
    wait = b"wait" + b"w" * MIN_BYTES
    beside = b"b" * MIN_BYTES
    with_metadata = ep.ProcessingRequest(
        request_body=ep.HttpBody(body=beside),
        metadata_context=base_pb2.Metadata(filter_metadata={"f": {}}),
    ).SerializeToString()
    await peer.send(sid, _message(b"one") + _message(large))
    await _answered(peer, sid, 2)
    await peer.send(sid, grpc_message(with_metadata) + _message(wait) + _message(large))
    await _until(lambda: len(Recorder.seen) == 4)
    Recorder.go.set()
    await _answered(peer, sid, 5)
    await peer.send(sid, _message(b""), end=True)
    assert await peer.until(lambda _: status_of(peer, sid) == 0)
    assert _answers(peer, sid) == [b"one", large, beside, wait, large, b""]
    assert BodyTaker.ways == [
        ("answer", b"one"),
        ("answer_body", large),
        ("answer", beside),
        ("answer_body", wait),
        ("answer_body", large),
        ("answer", b""),
    ]
    (waited_in,) = Recorder.awaited_in
    assert [task for _, task, _ in Recorder.seen][3:5] == [None, waited_in]
    peer.close()
