"""A request body's message read without protobuf (`body_envelope.body_span`): where its
bytes lie when the message is a request body and nothing else, None for any other message
(protobuf reads those). Whatever the bytes, a span found is what protobuf reads."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError
from hypothesis import example, given, settings
from hypothesis import strategies as st

from switchyard_mw._protos.envoy.config.core.v3 import base_pb2
from switchyard_mw._protos.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from switchyard_mw.extproc.body_envelope import body_span


def _body(body: bytes, *, end: bool = False, metadata: bool = False) -> bytes:
    """A request body's message as protobuf writes it; `metadata`: beside an empty metadata
    context, as Envoy sends every message."""
    message = ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=end))
    if metadata:
        message.metadata_context.SetInParent()
    return message.SerializeToString()


def _taken(message: bytes) -> bytes | None:
    span = body_span(memoryview(message))
    return None if span is None else message[span[0] : span[1]]


@pytest.mark.parametrize("size", [0, 1, 127, 128, 16_383, 16_384, 131_072, 2**21 + 3])
@pytest.mark.parametrize("end", [False, True])
@pytest.mark.parametrize("metadata", [False, True])
def test_a_request_body_is_found_where_it_lies(size: int, end: bool, metadata: bool) -> None:
    body = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    message = _body(body, end=end, metadata=metadata)
    assert message.endswith(b"\x42\x00") is metadata
    assert _taken(message) == body


def test_envoys_own_request_body_is_found() -> None:
    """As Envoy 1.40 sent a 1 KB body to the processor (recorded): the body, its flag and an
    empty metadata context."""
    body = b'{"max_tokens":16,"messages":[{"role":"user","content":"hi"}],"stream":false}'
    message = b"\x22" + bytes([len(body) + 4]) + b"\x0a" + bytes([len(body)]) + body
    message += b"\x10\x01\x42\x00"
    assert _taken(message) == body
    assert ep.ProcessingRequest.FromString(message).request_body.body == body


@pytest.mark.parametrize(
    "message",
    [
        ep.ProcessingRequest(),
        ep.ProcessingRequest(request_headers=ep.HttpHeaders(end_of_stream=True)),
        ep.ProcessingRequest(response_body=ep.HttpBody(body=b"answer", end_of_stream=True)),
        ep.ProcessingRequest(request_trailers=ep.HttpTrailers()),
        # a body with anything beside it but an empty metadata context is protobuf's to read
        ep.ProcessingRequest(
            request_body=ep.HttpBody(body=b"{}"),
            metadata_context=base_pb2.Metadata(filter_metadata={"f": {}}),
        ),
        ep.ProcessingRequest(request_body=ep.HttpBody(body=b"{}"), observability_mode=True),
    ],
    ids=["empty", "headers", "response body", "trailers", "with metadata", "with a flag"],
)
def test_any_other_message_is_left_to_protobuf(message: ep.ProcessingRequest) -> None:
    assert _taken(message.SerializeToString()) is None


@pytest.mark.parametrize(
    "message",
    [
        b"\x22",  # the body's message announced, its length cut
        b"\x22\x05\x0a\x03ab",  # shorter than it says
        b"\x22\x04\x0a\x03abcd",  # longer than it says
        b"\x22\x03\x0a\x05abc",  # a body over the message that holds it
        b"\x22\x04\x0a\x02ab\x10",  # end_of_stream without its value
        b"\x22\x02\x10\x01\x0a\x00",  # a body after the flag: protobuf's order, not ours
        b"\x22\x04\x0a\x00\x0a\x00",  # the body twice
        b"\x22\x0b\x10" + b"\xff" * 10,  # a varint of 11 bytes
        b"\x22\x80",  # a length whose varint never ends
        b"\x22\x02\x0a\x00\x42\x01\x00",  # a metadata context that holds something
        b"\x22\x02\x0a\x00\x42\x00\x42\x00",  # the metadata context twice
        b"\x22\x02\x0a\x00\x50\x00",  # another field in its place
    ],
)
def test_a_message_cut_or_out_of_shape_is_left_to_protobuf(message: bytes) -> None:
    assert _taken(message) is None


_FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "request_body": st.builds(
            ep.HttpBody, body=st.binary(max_size=300), end_of_stream=st.booleans()
        ),
        "response_body": st.builds(ep.HttpBody, body=st.binary(max_size=20)),
        "observability_mode": st.booleans(),
        "metadata_context": st.sampled_from(
            [base_pb2.Metadata(), base_pb2.Metadata(filter_metadata={"f": {}})]
        ),
    },
)


@st.composite
def _messages(draw: st.DrawFn) -> bytes:
    """A message protobuf wrote, then maybe cut, or a byte of it changed."""
    data = ep.ProcessingRequest(**draw(_FIELDS)).SerializeToString()
    change = draw(st.sampled_from(["none", "cut", "byte", "append"]))
    if change == "cut" and data:
        return data[: draw(st.integers(0, len(data) - 1))]
    if change == "byte" and data:
        at = draw(st.integers(0, len(data) - 1))
        return data[:at] + bytes([draw(st.integers(0, 255))]) + data[at + 1 :]
    if change == "append":
        return data + draw(st.binary(min_size=1, max_size=8))
    return data


@settings(max_examples=1500, deadline=None)
@given(message=_messages())
@example(message=_body(b"", end=True))
@example(message=b"\x22\x02\x0a\x00")  # an empty body written out: protobuf reads it so too
@example(message=b"\x22\x03\x10\x81\x00")  # a flag's varint longer than it needs
@example(message=b"\x22\x0d\x0a\x00\x10" + b"\xff" * 9 + b"\x7f")  # ten bytes, the most
@example(message=b"\x22\x06\x0a\x83\x00abc")  # a body's length longer than it needs
def test_a_span_found_is_what_protobuf_reads(message: bytes) -> None:
    taken = _taken(message)
    try:
        parsed = ep.ProcessingRequest.FromString(message)
    except DecodeError:
        assert taken is None
        return
    others = {field.name for field, _ in parsed.ListFields()} - {"request_body"}
    empty_metadata = (
        parsed.HasField("metadata_context") and not parsed.metadata_context.ListFields()
    )
    plain = parsed.HasField("request_body") and others <= (
        {"metadata_context"} if empty_metadata else set()
    )
    if taken is not None:
        assert plain
        assert taken == parsed.request_body.body
    else:
        # What Envoy writes (protobuf's own serialization of a plain body) is always found.
        body = parsed.request_body
        written = _body(body.body, end=body.end_of_stream, metadata=empty_metadata)
        assert not (plain and message == written), message
