"""One gRPC call on the `h2` transport: its state, as named states and a transition table (in
the manner of hyper-h2's `h2/stream.py`), and what it holds while it lives.

A stream's life, from the server's side:

    OPEN --ANSWER--> ANSWERING --FINISH--> FINISHING --CLOSE--> CLOSED
     |                  |                     |
     REQUEST_END        REQUEST_END           REQUEST_END
     v                  v                     v
    REQUEST_DONE --ANSWER--> ANSWERING_REQUEST_DONE --FINISH--> FINISHING_REQUEST_DONE --CLOSE-->

- ANSWER: the first answer goes out, behind the response headers.
- REQUEST_END: the client ended its side (END_STREAM); Envoy mostly resets instead.
- FINISH: the status is decided; the trailers carrying it wait behind the answers still
  queued (a window the peer has not opened). A stream with nothing answered is finished by a
  trailers-only answer at once, so FINISH is not an input of OPEN or REQUEST_DONE: those go
  straight to CLOSED.
- CLOSE: the trailers went out, or the peer reset the stream, or its connection went: it
  leaves the connection's table (its handler ends once its task has unwound).

A pair not in `TRANSITIONS` is a bug in the transport: `advance` raises a RuntimeError.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

from .h2_framing import OK, PREFIX_BYTES, MessageReader

if TYPE_CHECKING:
    import contextvars

    from .._protos.envoy.service.ext_proc.v3 import external_processor_pb2 as ep


class Task(Protocol):
    """What the driver answers a stream's messages in (an asyncio task), as the stream keeps
    it: this module, like the connection, knows no event loop."""

    def cancel(self) -> bool: ...
    def add_done_callback(self, fn: Callable[[Any], object], /) -> None: ...


Answer: TypeAlias = "ep.ProcessingResponse | None"
"""A stream's answer to one message (None: nothing to send for it now)."""
Answering: TypeAlias = "Awaitable[Answer] | Answer"
"""What a handler's `answer` gives: the answer itself, or an awaitable of it."""


class Handler(Protocol):
    """One ext_proc stream's state: answers each message in turn, released once at the end.

    `answer` gives the answer itself when it takes no waiting (the driver sends it at once,
    with no task), else an awaitable of it (the driver awaits it in a task, which answers the
    messages behind it too). None: nothing to send now (a stream that pushes its answers
    itself, see `h2_transport.Pushing`)."""

    def answer(self, request: ep.ProcessingRequest) -> Answering: ...


class TakesBody(Handler, Protocol):
    """A handler that takes a request body's bytes beside its message: a large message that
    is a request body (`body_envelope`) is handed to `answer_body` as the body itself, taken
    out of the gRPC message once, not parsed by protobuf (whose parse and `request_body.body`
    copy a body twice). It answers as `answer` answers that message."""

    def answer_body(self, body: bytes) -> Answering: ...


class StreamState(enum.IntEnum):
    """Where a stream is in its life (an IntEnum: the hot path hashes and compares ints)."""

    OPEN = 0
    """The request arriving; nothing answered yet."""
    REQUEST_DONE = 1
    """The request ended by the client; nothing answered yet."""
    ANSWERING = 2
    """Answers going out; the request still arriving."""
    ANSWERING_REQUEST_DONE = 3
    """Answers going out; the request ended."""
    FINISHING = 4
    """The status decided, its trailers behind queued answers; what still arrives is dropped."""
    FINISHING_REQUEST_DONE = 5
    """The same, the request ended."""
    CLOSED = 6
    """Out of the connection's table; nothing more is sent or taken."""


class StreamInput(enum.IntEnum):
    """What moves a stream from one state to the next."""

    ANSWER = 0
    REQUEST_END = 1
    FINISH = 2
    CLOSE = 3


_S = StreamState
_I = StreamInput
TRANSITIONS: dict[tuple[StreamState, StreamInput], StreamState] = {
    (_S.OPEN, _I.ANSWER): _S.ANSWERING,
    (_S.OPEN, _I.REQUEST_END): _S.REQUEST_DONE,
    (_S.OPEN, _I.CLOSE): _S.CLOSED,
    (_S.REQUEST_DONE, _I.ANSWER): _S.ANSWERING_REQUEST_DONE,
    (_S.REQUEST_DONE, _I.REQUEST_END): _S.REQUEST_DONE,  # h2 reports the end twice, see below
    (_S.REQUEST_DONE, _I.CLOSE): _S.CLOSED,
    (_S.ANSWERING, _I.REQUEST_END): _S.ANSWERING_REQUEST_DONE,
    (_S.ANSWERING, _I.FINISH): _S.FINISHING,
    (_S.ANSWERING, _I.CLOSE): _S.CLOSED,
    (_S.ANSWERING_REQUEST_DONE, _I.REQUEST_END): _S.ANSWERING_REQUEST_DONE,
    (_S.ANSWERING_REQUEST_DONE, _I.FINISH): _S.FINISHING_REQUEST_DONE,
    (_S.ANSWERING_REQUEST_DONE, _I.CLOSE): _S.CLOSED,
    (_S.FINISHING, _I.REQUEST_END): _S.FINISHING_REQUEST_DONE,
    (_S.FINISHING, _I.FINISH): _S.FINISHING,  # failed again while its answers wait: one status
    (_S.FINISHING, _I.CLOSE): _S.CLOSED,
    (_S.FINISHING_REQUEST_DONE, _I.REQUEST_END): _S.FINISHING_REQUEST_DONE,
    (_S.FINISHING_REQUEST_DONE, _I.FINISH): _S.FINISHING_REQUEST_DONE,
    (_S.FINISHING_REQUEST_DONE, _I.CLOSE): _S.CLOSED,
    # A closed stream's task may still unwind and report (a late failure, a cancellation).
    (_S.CLOSED, _I.REQUEST_END): _S.CLOSED,
    (_S.CLOSED, _I.FINISH): _S.CLOSED,
    (_S.CLOSED, _I.CLOSE): _S.CLOSED,
}
"""(state, input) -> next state. h2 reports a request's end twice when it comes on the
HEADERS frame (`RequestReceived.stream_ended`, then `StreamEnded`): REQUEST_END leaves a
state whose request is done as it is."""

UNANSWERED = frozenset({_S.OPEN, _S.REQUEST_DONE})
"""Nothing sent yet: the first answer goes behind response headers, a status alone is a
trailers-only answer."""
TAKING = frozenset({_S.OPEN, _S.REQUEST_DONE, _S.ANSWERING, _S.ANSWERING_REQUEST_DONE})
"""Messages received are handed to the handler (later, in FINISHING, they are dropped)."""
REQUEST_DONE = frozenset({_S.REQUEST_DONE, _S.ANSWERING_REQUEST_DONE, _S.FINISHING_REQUEST_DONE})
"""The client ended its side."""
FINISHING = frozenset({_S.FINISHING, _S.FINISHING_REQUEST_DONE})


def advance(state: StreamState, event: StreamInput) -> StreamState:
    """The state after `event`; a RuntimeError (a bug in the transport) for an input `state`
    does not take."""
    try:
        return TRANSITIONS[state, event]
    except KeyError:
        raise RuntimeError(f"stream state: {event.name} in {state.name}") from None


class Stream(MessageReader):
    """One gRPC call: its state and the bytes it holds (a `MessageReader` of its request; see
    there why a subclass), and what runs its handler.

    The connection (`h2_connection`, sans-IO) owns the state, the bytes and `working`; the
    driver that runs handlers (`h2_transport`) keeps its `handler`, `context` and `task` here
    too: one object per stream on the hot path, not two."""

    __slots__ = (
        "answer_body",
        "context",
        "detail",
        "handler",
        "held",
        "metadata",
        "method",
        "out",
        "partial_at",
        "pending",
        "service",
        "sid",
        "state",
        "status",
        "task",
        "working",
    )

    def __init__(self, sid: int, method: bytes) -> None:
        self.parts = []  # `MessageReader`'s, set here: a call fewer per stream
        self.size = 0
        self.need = PREFIX_BYTES
        self.sid = sid
        self.method = method
        self.state = StreamState.OPEN
        self.metadata: list[tuple[str, bytes]] | None = None
        """A Process call's request headers that are not pseudo-headers: its handler's."""
        self.handler: Handler | None = None
        self.answer_body: Callable[[bytes], Answering] | None = None
        """The handler's `answer_body`, when it is a `TakesBody`."""
        self.context: contextvars.Context | None = None
        self.pending: deque[memoryview] = deque()
        """Whole messages not yet handed to the handler."""
        self.task: Task | None = None
        """The driver's: answering the pending messages, one after the other."""
        self.working = False
        """The driver was asked to answer the pending messages (`Event.WORK`) and has not said
        it is done: messages that arrive meanwhile join the queue it is taking from."""
        self.out: deque[memoryview] = deque()
        """Answers (framed) not yet handed to h2: the peer's window holds them back."""
        self.held = 0
        """Bytes in the message reader, `pending` and `out`: what the stream costs while the
        peer waits."""
        self.partial_at = 0.0
        """When the message now arriving started."""
        self.status = OK
        self.detail = ""
        self.service: str | None = None
        """A health call's service, once its request came."""

    def step(self, event: StreamInput) -> StreamState:
        """Move to the state after `event`; the state before."""
        before = self.state
        try:  # `advance`, inline: a call fewer per step on the hot path
            self.state = TRANSITIONS[before, event]
        except KeyError:
            raise RuntimeError(f"stream state: {event.name} in {before.name}") from None
        return before

    def unanswered_work(self) -> bool:
        """Whether a reset now would cut work short: nothing answered yet, a message being
        answered, or one received (whole or in part) and not yet taken.

        A reset after every message was answered cuts nothing: it is how Envoy ends each
        ext_proc stream once it has the last answer it needs, so counting it would close
        Envoy's connection under steady traffic.
        """
        return self.state in UNANSWERED or self.working or bool(self.pending) or self.size > 0
