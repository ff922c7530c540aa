"""The public model name spliced into answers (`answer_names`): JSON answers and the
events of all three wires, streams cut at every byte, what must stay untouched."""

from __future__ import annotations

import json

import pytest

from switchyard_mw.accounts import build_accounts
from switchyard_mw.answer_names import (
    HOLD_MAX,
    INCOMPLETE,
    AnswerNamer,
    StreamNamer,
    answer_with_model,
    find_model,
    namer_for,
)
from switchyard_mw.config import parse_config

PUBLIC = "claude-opus-5"

MESSAGES = (
    b'{"id":"msg_1","type":"message","role":"assistant","model":"vendor.claude-opus-5-v1:0",'
    b'"content":[{"type":"tool_use","id":"t","name":"f","input":{"model":"keep-me"}}],'
    b'"stop_reason":"tool_use","usage":{"input_tokens":3,"output_tokens":4}}'
)
CHAT = (
    b'{"id":"c","object":"chat.completion","created":1,"model":"gpt-x-2026-01-01",'
    b'"choices":[{"index":0,"message":{"role":"assistant","content":"the \\"model\\": x"}}]}'
)
RESPONSES = (
    b'{"id":"r","object":"response","instructions":"say {\\"model\\":1} [",'
    b'"model" : "gpt-x-prod","output":[],"usage":{"input_tokens":1,"output_tokens":2}}'
)


@pytest.mark.parametrize("body", [MESSAGES, CHAT, RESPONSES])
def test_a_json_answer_gets_the_public_name_and_nothing_else_changes(body: bytes) -> None:
    out = answer_with_model(body, PUBLIC)
    before, after = json.loads(body), json.loads(out)
    assert after["model"] == PUBLIC
    assert {**before, "model": PUBLIC} == after
    assert out.replace(b'"' + PUBLIC.encode() + b'"', b"") == body.replace(
        b'"' + before["model"].encode() + b'"', b""
    )  # the rest byte for byte


def test_nested_model_keys_and_strings_stay() -> None:
    out = json.loads(answer_with_model(MESSAGES, PUBLIC))
    assert out["content"][0]["input"] == {"model": "keep-me"}
    nested_only = b'{"id":"x","meta":{"model":"inner"}}'
    assert answer_with_model(nested_only, PUBLIC) == nested_only


@pytest.mark.parametrize(
    "body",
    [b'{"model":null}', b"not json", b"", b'{"model":42}', b'["model"]', b'{"a":"model"}'],
)
def test_what_has_no_model_name_passes_unchanged(body: bytes) -> None:
    assert answer_with_model(body, PUBLIC) == body


def test_an_escaped_name_is_encoded_as_json() -> None:
    out = answer_with_model(b'{"model":"x"}', 'we"ird\\')
    assert json.loads(out) == {"model": 'we"ird\\'}


def _events(*datas: dict[str, object], names: tuple[str, ...] = ()) -> bytes:
    out = b""
    for i, data in enumerate(datas):
        if names:
            out += b"event: " + names[i].encode() + b"\n"
        out += b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"
    return out


ANTHROPIC_STREAM = _events(
    {"type": "message_start", "message": {"id": "m", "model": "vendor.x", "content": []}},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "model"}},
    {
        "type": "content_block_delta",
        "index": 1,
        "delta": {"type": "input_json_delta", "partial_json": '{"model": "y"}'},
    },
    {"type": "message_delta", "usage": {"output_tokens": 3}},
    {"type": "message_stop"},
    names=("message_start", "content_block_delta", "content_block_delta", "message_delta", "x"),
)
CHAT_STREAM = (
    _events(
        *(
            {"id": "c", "object": "chat.completion.chunk", "model": "gpt-x-prod", "choices": [c]}
            for c in ({"delta": {"content": "a"}}, {"delta": {"content": '"model":'}})
        )
    )
    + b"data: [DONE]\n\n"
)
RESPONSES_STREAM = _events(
    {"type": "response.created", "sequence_number": 0, "response": {"id": "r", "model": "p"}},
    {"type": "response.output_text.delta", "sequence_number": 1, "delta": "model"},
    {
        "type": "response.completed",
        "sequence_number": 2,
        "response": {"instructions": "x" * 300, "model": "p", "output": [{"model": "n"}]},
    },
    names=("response.created", "response.output_text.delta", "response.completed"),
)


def _decoded(stream: bytes) -> list[object]:
    return [json.loads(line[5:]) for line in stream.split(b"\n") if line.startswith(b"data: {")]


def _expected(stream: bytes) -> list[object]:
    out = []
    for event in _decoded(stream):
        assert isinstance(event, dict)
        if event.get("object") == "chat.completion.chunk":
            event = {**event, "model": PUBLIC}
        for wrapper in ("message", "response"):
            if isinstance(event.get(wrapper), dict) and "model" in event[wrapper]:
                event = {**event, wrapper: {**event[wrapper], "model": PUBLIC}}
        out.append(event)
    return out


@pytest.mark.parametrize("stream", [ANTHROPIC_STREAM, CHAT_STREAM, RESPONSES_STREAM])
def test_each_event_that_names_the_model_names_the_public_one(stream: bytes) -> None:
    namer = StreamNamer(PUBLIC)
    out = namer.feed(stream) + namer.end()
    assert _decoded(out) == _expected(stream)
    assert out.count(b"\n") == stream.count(b"\n")  # the framing untouched
    assert b'"model":"n"' in out or stream is not RESPONSES_STREAM  # a nested key stays


@pytest.mark.parametrize("stream", [ANTHROPIC_STREAM, CHAT_STREAM, RESPONSES_STREAM])
@pytest.mark.parametrize("size", [1, 2, 7, 64])
def test_a_stream_cut_anywhere_reads_the_same(stream: bytes, size: int) -> None:
    namer = StreamNamer(PUBLIC)
    pieces = [namer.feed(stream[i : i + size]) for i in range(0, len(stream), size)]
    assert b"".join(pieces) + namer.end() == StreamNamer(PUBLIC).feed(stream)
    assert namer.held == 0


def test_whole_lines_go_on_at_once_and_a_line_waits_only_for_its_model() -> None:
    namer = StreamNamer(PUBLIC)
    start = b'data: {"type":"response.completed","response":{"model":"p","output":["'
    assert namer.feed(start[:30]) == b""  # the model may still come
    passed = namer.feed(start[30:])
    assert passed == start.replace(b'"p"', b'"claude-opus-5"')  # on before the line ends
    assert namer.feed(b'x"]}}\n\n') == b'x"]}}\n\n'  # the rest passes unread
    no_model = b'data: {"type":"response.output_text.delta","delta":"hi"}\n\n'
    assert namer.feed(no_model) == no_model


def test_a_line_too_long_to_hold_goes_on_unchanged() -> None:
    namer = StreamNamer(PUBLIC)
    line = b'data: {"type":"response.completed","response":{"instructions":"' + b"x" * HOLD_MAX
    assert namer.feed(line) == line
    assert namer.held == 0
    assert namer.feed(b'","model":"p"}}\n') == b'","model":"p"}}\n'


def test_a_long_json_answer_fed_in_pieces_holds_only_its_opening() -> None:
    body = MESSAGES[:-1] + b',"pad":"' + b"y" * 200_000 + b'"}'
    namer = AnswerNamer(PUBLIC)
    first = namer.feed(body[:40])
    assert first == b""  # `model` not whole yet
    second = namer.feed(body[40:1000])
    assert namer.held == 0
    rest = namer.feed(body[1000:])
    assert rest == body[1000:]
    assert json.loads(first + second + rest + namer.end())["model"] == PUBLIC


def test_a_json_answer_held_goes_on_once_its_model_is_whole_or_it_ends() -> None:
    namer = AnswerNamer(PUBLIC)
    assert namer.feed(b'{"id":"a","mo') == b""
    assert namer.feed(b'del":"vendor') == b""
    assert namer.feed(b'.x","b":1}') == b'{"id":"a","model":"claude-opus-5","b":1}'
    assert namer.end() == b""
    cut = AnswerNamer(PUBLIC)
    assert cut.feed(b'{"model":"vendor') == b""
    assert cut.end() == b'{"model":"vendor'  # ended inside its model: as it came


def test_find_model_tells_a_cut_text_from_one_without_a_model() -> None:
    assert find_model(b'{"id":"a', 0, 8, wrapped=False, whole=False) is INCOMPLETE
    assert find_model(b'{"id":"a"}', 0, 10, wrapped=False, whole=False) is None
    assert find_model(b'{"message":{"model":"x"}}', 0, 25, wrapped=False, whole=True) is None
    found = find_model(b'{"message":{"model":"x"}}', 0, 25, wrapped=True, whole=True)
    assert found is not None
    assert (found.start, found.end) == (20, 23)


ACCOUNTS = """
[llm_clients.vendor]
base_url = "http://vendor"
api_key_env = "K"
models = { "claude-opus-5" = "vendor.claude-opus-5-v1:0", "same" = "same" }

[llm_clients.plain]
base_url = "http://plain"
api_key_env = "K"
models = ["claude-opus-5"]
"""


def test_only_an_account_that_renames_the_model_renames_its_answers() -> None:
    config = parse_config(ACCOUNTS)
    accounts = build_accounts(config, {"K": "k"})
    vendor, plain = accounts["vendor"], accounts["plain"]
    assert vendor.answer_name is None  # unbound: no model yet
    bound = vendor.for_model("claude-opus-5")
    assert bound.answer_name == "claude-opus-5"
    assert vendor.for_model("same").answer_name is None
    assert plain.for_model("claude-opus-5").answer_name is None
    assert plain.for_model("claude-opus-5").answer_namer("application/json") is None
    assert isinstance(bound.answer_namer("text/event-stream; charset=utf-8"), StreamNamer)
    assert isinstance(bound.answer_namer(b"application/json"), AnswerNamer)
    assert bound.answer_namer("application/json", "gzip") is None  # compressed: not renamed
    assert bound.answer_namer("text/plain") is None


def test_what_an_answer_is_renamed_by_follows_its_headers() -> None:
    assert isinstance(namer_for(PUBLIC, b"Text/Event-Stream", b"identity"), StreamNamer)
    assert isinstance(namer_for(PUBLIC, b"application/json", b" "), AnswerNamer)
    assert namer_for(PUBLIC, b"application/json", b"br") is None


def _chunk(model: str, extra: str = "") -> bytes:
    return (
        b'data: {"id":"c","object":"chat.completion.chunk","model":"'
        + model.encode()
        + b'"'
        + extra.encode()
        + b',"choices":[]}\n\n'
    )


def test_later_chunks_are_renamed_as_the_first_spelled_the_member() -> None:
    namer = StreamNamer(PUBLIC)
    first = namer.feed(_chunk("p") + _chunk("p"))
    assert first == _chunk(PUBLIC) * 2
    assert namer.feed(_chunk("p") * 3) == _chunk(PUBLIC) * 3


def test_a_piece_with_another_model_member_is_read_line_by_line() -> None:
    namer = StreamNamer(PUBLIC)
    namer.feed(_chunk("p"))
    nested = ',"meta":{"model":"other"}'
    out = namer.feed(_chunk("p", nested) + _chunk("p"))
    assert out == _chunk(PUBLIC, nested) + _chunk(PUBLIC)
    mixed = StreamNamer(PUBLIC).feed(_chunk("p") + _chunk("p", nested))
    assert mixed == _chunk(PUBLIC) + _chunk(PUBLIC, nested)
    other_spelling = b'data: {"id":"c","model": "p","choices":[]}\n\n'
    renamed = namer.feed(other_spelling)
    assert json.loads(renamed[6:])["model"] == PUBLIC
