"""`relay_stream`: an upstream's streamed answer relayed whole event by whole event, ended with
the wire's error event when the upstream breaks, the answer closed however it ends.

In process: an httpx client over a `MockTransport` whose body yields the given pieces and then
raises, as a reset upstream does (httpx's `ReadError`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import msgspec
import pytest
from openai.types.responses import ResponseErrorEvent

from switchyard_mw import relay_stream
from switchyard_mw.context import RequestContext, current_var
from switchyard_mw.wire import Wire, read_request

MESSAGE_START = (
    b'event: message_start\ndata: {"type":"message_start","message":{"usage":'
    b'{"input_tokens":12,"output_tokens":1}}}\n\n'
)
DELTA = (
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
    b'"delta":{"type":"text_delta","text":"Hi"}}\n\n'
)
PATHS = {
    Wire.ANTHROPIC: "/v1/messages",
    Wire.OPENAI_CHAT: "/v1/chat/completions",
    Wire.OPENAI_RESPONSES: "/v1/responses",
}


class Body(httpx.AsyncByteStream):
    """The pieces, then `error` raised (None: the body ends); remembers being closed."""

    def __init__(self, pieces: list[bytes], error: Exception | None) -> None:
        self.pieces, self.error, self.closed = pieces, error, False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for piece in self.pieces:
            yield piece
        if self.error is not None:
            raise self.error

    async def aclose(self) -> None:
        self.closed = True


async def answer(body: Body, path: str = "/v1/messages") -> httpx.Response:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=body)

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    request = client.build_request("POST", f"http://upstream.test{path}", content=b"{}")
    return await client.send(request, stream=True)


async def relayed(response: httpx.Response) -> list[bytes]:
    return [piece async for piece in relay_stream(response)]


@pytest.fixture
def ctx(request: pytest.FixtureRequest) -> Iterator[RequestContext]:
    """The request's context, as the stack sets it (its wire from the parametrized `wire`)."""
    wire = getattr(request, "param", Wire.ANTHROPIC)
    body = msgspec.json.encode({"model": "m", "messages": [], "input": "hi"})
    context = RequestContext(view=read_request(wire, body), body=body)
    token = current_var.set(context)
    yield context
    current_var.reset(token)


async def test_whole_events_pass_and_a_cut_event_waits_for_its_rest(ctx: RequestContext) -> None:
    body = Body([MESSAGE_START + DELTA[:30], DELTA[30:], b"event: message_stop\n"], None)
    pieces = await relayed(await answer(body))
    # The second piece completes the delta; the stream's own unfinished tail passes at the end.
    assert pieces == [MESSAGE_START, DELTA, b"event: message_stop\n"]
    assert body.closed
    assert ctx.upstream_status is None
    assert (ctx.input_tokens, ctx.output_tokens) == (12, 1)


async def test_a_break_mid_event_ends_with_anthropics_error_event(ctx: RequestContext) -> None:
    body = Body([MESSAGE_START, DELTA[:30]], httpx.ReadError("connection reset"))
    pieces = await relayed(await answer(body))
    assert pieces[0] == MESSAGE_START
    # The half event never reaches the client: the error event follows the last whole one.
    name, data = pieces[1].decode().removesuffix("\n\n").split("\n")
    assert name == "event: error"
    assert json.loads(data.removeprefix("data: ")) == {
        "type": "error",
        "error": {"type": "upstream_error", "message": "upstream stream failed: ReadError"},
    }
    assert len(pieces) == 2
    assert body.closed
    assert ctx.upstream_status == 502  # the cooling policy counts the account's fault
    assert ctx.input_tokens == 12  # what the stream reported before it broke


@pytest.mark.parametrize("ctx", [Wire.OPENAI_CHAT], indirect=True)
async def test_a_break_ends_a_chat_stream_with_its_error_chunk(ctx: RequestContext) -> None:
    chunk = b'data: {"id":"c","object":"chat.completion.chunk","choices":[]}\n\n'
    pieces = await relayed(await answer(Body([chunk], httpx.RemoteProtocolError("cut")), "/x"))
    assert pieces[0] == chunk
    error: Any = json.loads(pieces[1].decode().removeprefix("data: "))
    assert error == {
        "error": {
            "message": "upstream stream failed: RemoteProtocolError",
            "type": "upstream_error",
            "code": "upstream_error",
        }
    }


@pytest.mark.parametrize("ctx", [Wire.OPENAI_RESPONSES], indirect=True)
async def test_a_break_ends_a_responses_stream_numbered_after_its_last_event(
    ctx: RequestContext,
) -> None:
    events = [
        b'event: response.created\ndata: {"type":"response.created","sequence_number":0}\n\n',
        b'event: response.in_progress\ndata: {"type":"response.in_progress",'
        b'"sequence_number":1}\n\n',
    ]
    pieces = await relayed(await answer(Body(events, httpx.ReadTimeout("idle"))))
    assert pieces[:2] == events
    name, data = pieces[2].decode().removesuffix("\n\n").split("\n")
    assert name == "event: error"
    event = ResponseErrorEvent.model_validate_json(data.removeprefix("data: "))
    assert (event.code, event.param, event.sequence_number) == ("upstream_error", None, 2)
    assert event.message == "upstream stream failed: ReadTimeout"


@pytest.mark.parametrize(("wire", "path"), [*PATHS.items(), (Wire.GENERIC, "/v1/embeddings")])
async def test_without_a_stack_the_wire_is_the_upstream_paths(wire: Wire, path: str) -> None:
    # An Azure-style path template ends as the API's own path does.
    prefixed = path.replace("/v1/", "/openai/deployments/d/")
    for url_path in (path, prefixed):
        pieces = await relayed(await answer(Body([], httpx.ReadError("reset")), url_path))
        named = pieces[-1].startswith(b"event: error\n")
        assert named == (wire in (Wire.ANTHROPIC, Wire.OPENAI_RESPONSES)), (url_path, pieces)
        assert (b'"sequence_number"' in pieces[-1]) == (wire is Wire.OPENAI_RESPONSES)


async def test_a_client_that_leaves_closes_the_answer(ctx: RequestContext) -> None:
    body = Body([MESSAGE_START, DELTA, DELTA], None)
    stream = relay_stream(await answer(body))
    assert await anext(stream) == MESSAGE_START
    await stream.aclose()  # what the server does when the client goes away
    assert body.closed
    assert ctx.upstream_status is None


async def test_what_is_not_a_transport_failure_passes_unchanged(ctx: RequestContext) -> None:
    body = Body([MESSAGE_START], ValueError("a bug of the app's"))
    with pytest.raises(ValueError, match="a bug"):
        await relayed(await answer(body))
    assert body.closed
