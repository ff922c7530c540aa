"""The cloud filter's stream (`extproc.cloud`) message by message, as Envoy drives it: the
cases a real Envoy and the mock do not show (an api account's attempt, a stream cut inside an
event-stream frame, an error answer without a body, a request it does not know)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from extproc_helpers import (
    Stream,
    common,
    request_body,
    request_headers,
    response_body,
    response_headers,
    sets,
)
from switchyard_mw.accounts import build_accounts
from switchyard_mw.config import parse_config
from switchyard_mw.core.eventstream import encode
from switchyard_mw.extproc import ExtProcServicer, Policies

pytest.importorskip("botocore")

RID = "rid-cloud"
CLOUD = [("x-switchyard-filter", "cloud")]
MODEL_ID = "us.anthropic.claude-opus-5-v1:0"
CONFIG = f"""
[llm_clients.aws]
kind = "bedrock"
base_url = "http://bedrock.test"
bedrock = {{ region = "us-east-1" }}
models = {{ "m" = "{MODEL_ID}" }}
envoy_cluster = "cloud"

[llm_clients.api]
base_url = "http://api.test"
api_key_env = "KEY"
models = ["plain"]
envoy_cluster = "cloud"
"""


@pytest.fixture(autouse=True)
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIATEST")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)


async def _routed(model: str, *, stream: bool) -> tuple[ExtProcServicer, Stream]:
    """A servicer whose router-level stream took a request for `model`, and a cloud-filter
    stream of its first attempt, its request headers and body sent."""
    config = parse_config(CONFIG)
    servicer = ExtProcServicer(Policies(config, build_accounts(config, {"KEY": "k"})))
    router = Stream(servicer)
    body = msgspec.json.encode(
        {"model": model, "max_tokens": 9, "stream": stream, "messages": [{"role": "user"}]}
    )
    await router.send(request_headers(extra={"x-request-id": RID}))
    await router.send(request_body(body))
    cloud = Stream(servicer, CLOUD)
    await cloud.send(request_headers(extra={"x-request-id": RID}))
    return servicer, cloud


def _body_of(answer: Any) -> bytes:
    return bytes(common(answer).body_mutation.body)


async def test_a_bedrock_attempt_is_enveloped_and_signed() -> None:
    _, cloud = await _routed("m", stream=True)
    sent = msgspec.json.encode({"model": MODEL_ID, "stream": True, "max_tokens": 9})
    answer = await cloud.send(request_body(sent))
    headers = sets(answer)
    assert headers[":path"] == f"/model/{MODEL_ID}/invoke-with-response-stream".encode()
    assert headers[":authority"] == b"bedrock.test"
    assert headers["authorization"].startswith(b"AWS4-HMAC-SHA256 Credential=AKIATEST/")
    assert headers["content-length"] == str(len(_body_of(answer))).encode()
    assert "x-api-key" in common(answer).header_mutation.remove_headers
    assert b'"model"' not in _body_of(answer)


async def test_an_api_accounts_attempt_passes_unchanged() -> None:
    _, cloud = await _routed("plain", stream=False)
    answer = await cloud.send(request_body(b'{"model":"plain"}'))
    assert not common(answer).HasField("body_mutation")
    assert not common(answer).header_mutation.set_headers
    answer = await cloud.send(response_headers(500, {"content-type": "application/json"}))
    assert answer == type(answer)(response_headers=answer.response_headers)
    assert not answer.HasField("mode_override")


async def test_a_request_it_does_not_know_passes_unchanged() -> None:
    config = parse_config(CONFIG)
    servicer = ExtProcServicer(Policies(config, build_accounts(config, {"KEY": "k"})))
    cloud = Stream(servicer, CLOUD)
    await cloud.send(request_headers(extra={"x-request-id": "nobody"}))
    answer = await cloud.send(request_body(b"{}"))
    assert not common(answer).HasField("body_mutation")


async def test_a_bedrock_stream_cut_inside_a_frame_ends_with_the_error_event() -> None:
    _, cloud = await _routed("m", stream=True)
    await cloud.send(request_body(b'{"model":"m","stream":true}'))
    answer = await cloud.send(
        response_headers(200, {"content-type": "application/vnd.amazon.eventstream"})
    )
    assert sets(answer)["content-type"].startswith(b"text/event-stream")
    assert "content-length" in common(answer).header_mutation.remove_headers
    assert answer.mode_override.response_body_mode == answer.mode_override.STREAMED
    frame = encode({":message-type": "event", ":event-type": "chunk"}, b'{"bytes":""}')
    answer = await cloud.send(response_body(frame[:-3], end=True))
    sse = _body_of(answer)
    assert sse.startswith(b"event: error\ndata: ")
    assert b"ended inside a message" in sse


async def test_an_error_without_a_body_gets_the_mapped_status() -> None:
    """Bedrock's 404 ResourceNotFoundException is the account's 502 (the model is not
    offered to it): the status the refusal filter then reads."""
    _, cloud = await _routed("m", stream=False)
    await cloud.send(request_body(b'{"model":"m"}'))
    named = {"x-amzn-errortype": "ResourceNotFoundException:http://internal.amazon.com/"}
    answer = await cloud.send(response_headers(404, named, end=True))
    assert sets(answer)[":status"] == b"502"


async def test_an_error_is_read_whole_and_replaced_in_the_apis_shape() -> None:
    _, cloud = await _routed("m", stream=False)
    await cloud.send(request_body(b'{"model":"m"}'))
    named = {"x-amzn-errortype": "ThrottlingException", "content-type": "application/json"}
    answer = await cloud.send(response_headers(429, named))
    assert answer.mode_override.response_body_mode == answer.mode_override.BUFFERED
    answer = await cloud.send(response_body(b'{"message":"Too many requests"}', end=True))
    body = msgspec.json.decode(_body_of(answer))
    assert body["error"]["type"] == "rate_limit_error"
    assert body["error"]["message"] == "Bedrock: ThrottlingException: Too many requests"
    headers = sets(answer)
    assert headers[":status"] == b"429"
    assert headers["content-length"] == str(len(_body_of(answer))).encode()
