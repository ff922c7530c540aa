"""The router-level stream renames the answer's model and withholds the provider's headers
(message by message, as Envoy drives it; tests/extproc/test_envoy_public_model.py runs the
same through a real Envoy)."""

from __future__ import annotations

import msgspec
import pytest

from extproc_helpers import (
    Stream,
    removes,
    request_body,
    request_headers,
    response_body,
    response_headers,
    sets,
)
from switchyard_mw._protos.envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from switchyard_mw._protos.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from switchyard_mw.accounts import build_accounts
from switchyard_mw.config import parse_config
from switchyard_mw.extproc import ExtProcServicer, Policies
from switchyard_mw.extproc.flights import Flights

Mode = processing_mode_pb2.ProcessingMode
VENDOR = "vendor.claude-opus-5-v1:0"
CONFIG = f"""
[llm_clients.vendor]
base_url = "https://prov.example"
api_key_env = "K"
models = {{ "claude-opus-5" = "{VENDOR}" }}
envoy_cluster = "prov"
"""
REQUEST = {
    "model": "claude-opus-5",
    "max_tokens": 8,
    "messages": [{"role": "user", "content": "hi"}],
}
PROVIDER_HEADERS = {
    "request-id": "req_abc",
    "anthropic-organization-id": "org-1",
    "x-amzn-requestid": "aws-1",
    "x-amzn-bedrock-content-type": "application/json",
    "x-goog-trace": "g",
}
STREAM = (
    b"event: message_start\n"
    b'data: {"type":"message_start","message":{"id":"m","model":"' + VENDOR.encode() + b'",'
    b'"content":[],"usage":{"input_tokens":10,"output_tokens":1}}}\n\n'
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"hi"}}\n\n'
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
)


@pytest.fixture
def servicer() -> ExtProcServicer:
    config = parse_config(CONFIG)
    return ExtProcServicer(Policies(config, build_accounts(config, {"K": "k"})), Flights())


async def _answered(
    servicer: ExtProcServicer, headers: dict[str, str]
) -> tuple[Stream, ep.ProcessingResponse, ep.ProcessingResponse]:
    stream = Stream(servicer)
    await stream.send(request_headers("/v1/messages"))
    routed = await stream.send(request_body(msgspec.json.encode(REQUEST)))
    answer = await stream.send(response_headers(200, headers, details="via_upstream"))
    return stream, routed, answer


def _body_of(answer: ep.ProcessingResponse, piece: bytes) -> bytes:
    """What Envoy passes on for `piece` after this answer."""
    common = answer.response_body.response
    return common.body_mutation.body if common.HasField("body_mutation") else piece


async def test_a_stream_is_renamed_as_it_passes_and_the_providers_headers_stay_behind(
    servicer: ExtProcServicer,
) -> None:
    headers = {"content-type": "text/event-stream", "content-length": str(len(STREAM))}
    stream, routed, answer = await _answered(servicer, {**headers, **PROVIDER_HEADERS})
    assert sets(routed)["accept-encoding"] == b"identity"  # a renamed answer is read plain
    assert answer.mode_override.response_body_mode == Mode.STREAMED
    removed = removes(answer)
    assert set(PROVIDER_HEADERS) - {"request-id"} <= set(removed)
    assert "request-id" not in removed  # the SDKs read it
    assert "content-length" in removed  # pieces change length: Envoy chunks the answer
    assert sets(answer)["x-switchyard-upstream-request-id"] == b"req_abc"
    out = b""
    pieces = [STREAM[i : i + 5] for i in range(0, len(STREAM), 5)]
    for piece in pieces:
        out += _body_of(await stream.send(response_body(piece)), piece)
    out += _body_of(await stream.send(response_body(b"", end=True)), b"")
    assert out == STREAM.replace(VENDOR.encode(), b"claude-opus-5")
    await stream.close()


async def test_a_json_answer_read_whole_gets_its_new_length(servicer: ExtProcServicer) -> None:
    body = msgspec.json.encode({"id": "m", "type": "message", "model": VENDOR, "content": []})
    headers = {"content-type": "application/json", "content-length": str(len(body))}
    stream, _, answer = await _answered(servicer, headers)
    assert answer.mode_override.response_body_mode == Mode.BUFFERED
    assert "content-length" not in removes(answer)
    renamed = await stream.send(response_body(body, end=True))
    new = renamed.response_body.response.body_mutation.body
    assert msgspec.json.decode(new)["model"] == "claude-opus-5"
    assert sets(renamed)["content-length"] == str(len(new)).encode()
    await stream.close()


async def test_a_compressed_answer_keeps_its_bytes(servicer: ExtProcServicer) -> None:
    headers = {"content-type": "text/event-stream", "content-encoding": "gzip"}
    stream, _, answer = await _answered(servicer, headers)
    assert "content-length" not in removes(answer)
    piece = b"\x1f\x8b\x08\x00"
    unchanged = await stream.send(response_body(piece, end=True))
    assert not unchanged.response_body.HasField("response")
    await stream.close()


async def test_bedrocks_request_id_is_withheld_and_still_exposed(servicer: ExtProcServicer) -> None:
    """`x-amzn-requestid` names the provider (withheld) and is its request id (exposed)."""
    headers = {"content-type": "application/json", "x-amzn-requestid": "aws-1"}
    stream, _, answer = await _answered(servicer, headers)
    assert "x-amzn-requestid" in removes(answer)
    assert sets(answer)["x-switchyard-upstream-request-id"] == b"aws-1"
    await stream.close()
