"""The cloud filter's stream (`extproc.cloud`) message by message, as Envoy drives it: the
cases a real Envoy and the mock do not show (an api account's attempt, a stream cut inside an
event-stream frame, an error answer without a body, a request it does not know)."""

from __future__ import annotations

import base64
from typing import Any

import msgspec
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conftest import Metrics
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
from switchyard_mw.core.pool import Outcome
from switchyard_mw.extproc import ExtProcServicer, Policies
from switchyard_mw.telemetry import names as tm

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
    servicer, _, cloud = await _routed_with_router(model, stream=stream)
    return servicer, cloud


async def _routed_with_router(
    model: str, *, stream: bool, config_text: str = CONFIG
) -> tuple[ExtProcServicer, Stream, Stream]:
    """`_routed`, and the router-level stream (which gets the final answer)."""
    config = parse_config(config_text)
    servicer = ExtProcServicer(Policies(config, build_accounts(config, {"KEY": "k"})))
    router = Stream(servicer)
    body = msgspec.json.encode(
        {"model": model, "max_tokens": 9, "stream": stream, "messages": [{"role": "user"}]}
    )
    await router.send(request_headers(extra={"x-request-id": RID}))
    await router.send(request_body(body))
    cloud = Stream(servicer, CLOUD)
    await cloud.send(request_headers(extra={"x-request-id": RID}))
    return servicer, router, cloud


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


EVENTSTREAM = {"content-type": "application/vnd.amazon.eventstream"}
SSE = {"content-type": "text/event-stream"}


def _chunk(event: dict[str, Any]) -> bytes:
    """An Anthropic event in Bedrock's event-stream `chunk` message."""
    payload = {"bytes": base64.b64encode(msgspec.json.encode(event)).decode()}
    return encode({":message-type": "event", ":event-type": "chunk"}, msgspec.json.encode(payload))


OPENING = _chunk(
    {"type": "message_start", "message": {"usage": {"input_tokens": 3, "output_tokens": 1}}}
) + _chunk(
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "He"}}
)
CLOSING = _chunk(
    {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 2}}
) + _chunk({"type": "message_stop"})


def _exception(kind: str) -> bytes:
    """Bedrock's error after the stream started: an `exception` message (`kind` as a stream
    names it, e.g. `internalServerException`)."""
    headers = {":message-type": "exception", ":exception-type": kind}
    return encode(headers, b'{"message":"it broke"}')


async def _opened(router: Stream, cloud: Stream) -> bytes:
    """A Bedrock stream's opening (a content delta) through the cloud filter and on to the
    client: the router-level stream's headers and first piece. The SSE the client got."""
    await cloud.send(request_body(b'{"model":"m","stream":true}'))
    await cloud.send(response_headers(200, EVENTSTREAM))
    first = _body_of(await cloud.send(response_body(OPENING)))
    final = await router.send(response_headers(200, SSE, details="via_upstream"))
    assert final.mode_override.response_body_mode == final.mode_override.STREAMED
    await router.send(response_body(first))
    return first


async def _ended(router: Stream, cloud: Stream, later: bytes) -> bytes:
    """The rest of the stream, `later`, through the cloud filter and the router-level stream,
    the body's end. The SSE the client got of it."""
    rest = _body_of(await cloud.send(response_body(later, end=True)))
    await router.send(response_body(rest, end=True))
    await cloud.close()
    await router.close()
    return rest


async def _stream_to_end(router: Stream, cloud: Stream, later: bytes) -> bytes:
    return await _opened(router, cloud) + await _ended(router, cloud, later)


THRESHOLD_ONE = CONFIG.replace(
    'envoy_cluster = "cloud"', 'envoy_cluster = "cloud"\nfailure_threshold = 1', 1
)


@pytest.mark.parametrize(
    ("exception", "status", "error_type"),
    [
        ("internalServerException", "500", "api_error"),
        ("modelStreamErrorException", "502", "api_error"),
        ("serviceUnavailableException", "503", "overloaded_error"),
    ],
)
async def test_a_bedrock_exception_after_the_stream_started_is_the_accounts_fault(
    exception: str,
    status: str,
    error_type: str,
    otel_spans: InMemorySpanExporter,
    otel_metrics: Metrics,
) -> None:
    """The client already has the stream: its end is the error event, and the account is
    charged the fault the exception stands for, as the forwarding app charges it (the
    attempt is judged at the end of its body, not at its headers)."""
    servicer, router, cloud = await _routed_with_router("m", stream=True, config_text=THRESHOLD_ONE)
    faults = {tm.ACCOUNT: "aws", "status": status}
    before = otel_metrics.value("switchyard.account.faults", **faults)
    sse = await _stream_to_end(router, cloud, _exception(exception))
    assert b'"text":"He"' in sse
    assert sse.endswith(b"\n\n")
    assert f'"type":"{error_type}"'.encode() in sse.rsplit(b"event: error\n", 1)[1]
    pool = servicer.policies.pool
    assert pool.status_of("aws").state.value == "cooled"
    assert pool.status_of("aws").consecutive_faults == 1
    assert otel_metrics.value("switchyard.account.faults", **faults) == before + 1
    [attempt] = [s for s in otel_spans.get_finished_spans() if s.name == tm.SPAN_ATTEMPT]
    attributes = attempt.attributes or {}
    assert attributes[tm.ATTEMPT_STATUS] == status
    assert attributes[tm.ATTEMPT_OUTCOME] == "fault"
    [call] = [s for s in otel_spans.get_finished_spans() if s.name.startswith("chat ")]
    assert (call.attributes or {})[tm.ERROR_TYPE] == status


async def test_a_bedrock_throttle_after_the_stream_started_is_a_throttle() -> None:
    """`throttlingException` mid-stream stands for a 429: a throttle, neither a fault nor a
    success (the account's earlier fault stays counted)."""
    servicer, router, cloud = await _routed_with_router("m", stream=True)
    pool = servicer.policies.pool
    lease = pool.acquire("m")
    assert lease is not None
    pool.record(lease, Outcome.FAULT)
    await _stream_to_end(router, cloud, _exception("throttlingException"))
    assert pool.status_of("aws").consecutive_faults == 1
    assert pool.status_of("aws").state.value == "closed"


async def test_a_bedrock_stream_that_ends_well_is_a_success_at_its_end() -> None:
    """The same stream without the exception: a success, recorded when its body ended (an
    earlier fault forgotten)."""
    servicer, router, cloud = await _routed_with_router("m", stream=True)
    pool = servicer.policies.pool
    lease = pool.acquire("m")
    assert lease is not None
    pool.record(lease, Outcome.FAULT)
    await _opened(router, cloud)
    assert pool.status_of("aws").consecutive_faults == 1, "nothing settled at the headers"
    sse = await _ended(router, cloud, CLOSING)
    assert sse.endswith(b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
    assert pool.status_of("aws").consecutive_faults == 0


async def test_a_bedrock_stream_cut_inside_a_frame_after_it_started_is_the_accounts_fault(
    otel_metrics: Metrics,
) -> None:
    """As a stream that broke mid-way through the forwarding app: a 502 fault."""
    servicer, router, cloud = await _routed_with_router("m", stream=True)
    faults = {tm.ACCOUNT: "aws", "status": "502"}
    before = otel_metrics.value("switchyard.account.faults", **faults)
    await _opened(router, cloud)
    rest = await _ended(router, cloud, CLOSING[:-3])
    assert rest.startswith(b"event: error\ndata: ")
    assert servicer.policies.pool.status_of("aws").consecutive_faults == 1
    assert otel_metrics.value("switchyard.account.faults", **faults) == before + 1


async def test_a_client_that_leaves_after_the_error_event_leaves_the_fault_charged() -> None:
    """An SDK raises on the error event and hangs up: the router-level stream may end before
    Envoy sends it the body's end. The stream's error ended it all the same."""
    servicer, router, cloud = await _routed_with_router("m", stream=True, config_text=THRESHOLD_ONE)
    await _opened(router, cloud)
    rest = _body_of(await cloud.send(response_body(_exception("internalServerException"))))
    await router.send(response_body(rest))
    await router.close()  # no end_of_stream: Envoy ended the stream
    await cloud.close()
    assert servicer.policies.pool.status_of("aws").consecutive_faults == 1


async def test_a_client_that_leaves_mid_stream_settles_nothing() -> None:
    """Without the stream's error nothing says how it would have ended: no outcome (an
    earlier fault stays counted, no success forgets it), as through the forwarding app."""
    servicer, router, cloud = await _routed_with_router("m", stream=True)
    pool = servicer.policies.pool
    lease = pool.acquire("m")
    assert lease is not None
    pool.record(lease, Outcome.FAULT)
    await _opened(router, cloud)
    await router.close()
    await cloud.close()
    assert pool.status_of("aws").consecutive_faults == 1
