"""What Envoy lets an upstream-level ext_proc filter do to serve a Bedrock account, as
docs/envoy.md ("Cloud accounts") says: measured with a bare processor, not switchyard's, so
that the facts hold whatever the processor does with them.

The client is the official Anthropic SDK, streaming, pointed at Envoy; the upstream is the mock
provider's Bedrock face, which re-signs every request with botocore and refuses one whose
SigV4 signature does not match the method, path, host, signed headers and body it received.

The processor, in the upstream filter (request headers SEND, request body BUFFERED, response
headers SEND, response body STREAMED):
- answers the request headers with nothing, and the buffered body with the Bedrock envelope:
  `:path` (the model id in it), `:authority`, a body of another length with its
  `content-length`, and the `authorization`/`x-amz-date` signed over that very body;
- answers the response headers with `content-type: text/event-stream`, and each piece of the
  binary event-stream with the SSE events it completes (often another length, sometimes none).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import pytest

from envoy_rig import (
    EXTENSIONS,
    bare_processor,
    ext_proc_filter,
    port_of,
    probe_config,
    upstream_cluster,
)
from switchyard_mw._protos.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from switchyard_mw._protos.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from switchyard_mw.testing import Behaviour, MockProvider
from switchyard_mw.testing.envoy import envoy_binary, run_on_free_ports

pytestmark = pytest.mark.integration
pytest.importorskip("botocore")

from botocore.auth import SigV4Auth  # noqa: E402
from botocore.awsrequest import AWSRequest  # noqa: E402
from botocore.credentials import Credentials  # noqa: E402

from switchyard_mw.clouds.bedrock import BedrockCloud  # noqa: E402
from switchyard_mw.clouds.bedrock_stream import EVENTSTREAM_TYPE, BedrockStream  # noqa: E402
from switchyard_mw.testing._bedrock_face import (  # noqa: E402
    MOCK_AWS_ACCESS_KEY_ID,
    MOCK_AWS_SECRET_ACCESS_KEY,
)

MODEL_ID = "us.anthropic.claude-opus-5-v1:0"
REGION = "us-east-1"
REQUEST: dict[str, Any] = {
    "model": "claude-opus-5",
    "max_tokens": 50,
    "messages": [{"role": "user", "content": "hi"}],
}


def _content_type(headers: Any) -> str:
    for header in headers.headers.headers:
        if header.key == "content-type":
            return bytes(header.raw_value).decode()
    return ""


def _set(mutation: Any, key: str, value: str) -> None:
    option = mutation.set_headers.add()
    option.header.key, option.header.raw_value = key, value.encode()
    option.append_action = option.OVERWRITE_IF_EXISTS_OR_ADD


class BedrockEnvelopingProcessor(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """Re-envelopes and signs each request for Bedrock, and turns its event-stream into SSE."""

    def __init__(self, upstream_host: str, *, signs: bool = True) -> None:
        self.host = upstream_host
        self.signs = signs
        """False: Envoy's `aws_request_signing` filter, after this one, signs."""
        self.cloud = BedrockCloud("aws", REGION, f"http://{upstream_host}")
        self.sent: list[tuple[str, bytes]] = []  # (path, body) as the processor set them
        self.pieces: list[tuple[int, int]] = []  # (bytes in, bytes out) per response piece

    async def Process(self, requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        translator: BedrockStream | None = None  # set once the answer is an event-stream
        async for request in requests:
            kind = request.WhichOneof("request")
            answer = ep.ProcessingResponse()
            if kind == "request_body":
                self._envelope(request.request_body.body, answer)
            elif kind == "response_headers":
                answer.response_headers.SetInParent()
                if _content_type(request.response_headers) == EVENTSTREAM_TYPE:
                    translator = BedrockStream()
                    mutation = answer.response_headers.response.header_mutation
                    _set(mutation, "content-type", "text/event-stream")
                    mutation.remove_headers.append("content-length")
            elif kind == "response_body" and translator is None:
                answer.response_body.SetInParent()  # a JSON answer is Anthropic's already
                self.pieces.append((len(request.response_body.body),) * 2)
            elif kind == "response_body":
                piece = request.response_body
                sse = translator.feed(piece.body)
                if piece.end_of_stream:
                    sse += translator.end()
                self.pieces.append((len(piece.body), len(sse)))
                answer.response_body.response.body_mutation.body = sse
            else:
                getattr(answer, kind).SetInParent()
            yield answer

    def _envelope(self, body: bytes, answer: Any) -> None:
        """The body phase's answer: path, host, body and the signature over that body."""
        renamed = json.dumps({**json.loads(body), "model": MODEL_ID}).encode()
        envelope = self.cloud.envelope("/v1/messages", renamed)
        path = envelope.url.removeprefix(f"http://{self.host}")
        signed = AWSRequest(
            method="POST",
            url=envelope.url,
            data=envelope.body,
            headers={"content-type": "application/json"},
        )
        credentials = Credentials(MOCK_AWS_ACCESS_KEY_ID, MOCK_AWS_SECRET_ACCESS_KEY)
        SigV4Auth(credentials, "bedrock", REGION).add_auth(signed)
        common = answer.request_body.response
        common.body_mutation.body = envelope.body
        mutation = common.header_mutation
        _set(mutation, ":path", path)
        _set(mutation, ":authority", self.host)
        _set(mutation, "content-length", str(len(envelope.body)))
        for name in ("authorization", "x-amz-date", "x-amz-content-sha256"):
            if name in signed.headers and self.signs:
                _set(mutation, name, signed.headers[name])
        mutation.remove_headers.append("x-api-key")  # the caller's key never leaves
        self.sent.append((path, envelope.body))


def config(*, allow_all_routing: bool, envoy_signs: bool) -> str:
    """The provider's cluster with the processor's upstream filter (and Envoy's signer)."""
    processing = {
        "request_header_mode": "SEND",
        "request_body_mode": "BUFFERED",
        "response_header_mode": "SEND",
        "response_body_mode": "STREAMED",
        "request_trailer_mode": "SKIP",
        "response_trailer_mode": "SKIP",
    }
    rules = {"allow_all_routing": allow_all_routing}
    filters = [ext_proc_filter(processing, mutation_rules=rules)]
    if envoy_signs:
        filters.append(ENVOY_SIGNS)
    route = {"cluster": "provider", "timeout": "30s"}
    return probe_config(route, upstream_cluster("provider", filters=filters))


ENVOY_SIGNS = {
    "name": "envoy.filters.http.aws_request_signing",
    "typed_config": {
        "@type": f"{EXTENSIONS}.filters.http.aws_request_signing.v3.AwsRequestSigning",
        "service_name": "bedrock",
        "region": REGION,
        "use_unsigned_payload": False,
        "match_excluded_headers": [
            {"exact": name} for name in ("user-agent", "traceparent", "tracestate", "baggage")
        ],
        "credential_provider": {
            "inline_credential": {
                "access_key_id": MOCK_AWS_ACCESS_KEY_ID,
                "secret_access_key": MOCK_AWS_SECRET_ACCESS_KEY,
            }
        },
    },
}
"""Envoy's own SigV4 signer after the processor, with the body's hash (it buffers the body).
By default it signs nearly every header, `user-agent` and the trace headers too, which botocore
leaves out of a signature, so the mock's botocore check cannot verify them (measured: refused
until excluded; AWS itself verifies whatever SignedHeaders lists)."""


async def _through_envoy(
    mock_url: str, stream: bool, *, allow_all_routing: bool = True, envoy_signs: bool = False
) -> tuple[dict[str, Any], list[str], str, BedrockEnvelopingProcessor]:
    """The SDK's answer through Envoy and the processor: the final message, the event types
    it parsed, the response's content type, and the processor's record."""
    envoy_binary()  # raises, saying what to install, when there is no Envoy
    host = mock_url.removeprefix("http://")
    processor = BedrockEnvelopingProcessor(host, signs=not envoy_signs)
    text = config(allow_all_routing=allow_all_routing, envoy_signs=envoy_signs)
    types: list[str] = []
    async with bare_processor(processor) as port:
        with run_on_free_ports(text, processor=port, upstream=port_of(mock_url)) as envoy:
            client = anthropic.AsyncAnthropic(base_url=envoy.url, api_key="caller", max_retries=0)
            async with client:
                if stream:
                    async with client.messages.stream(**REQUEST) as events:
                        types = [event.type async for event in events]
                        message = await events.get_final_message()
                        content_type = events.response.headers["content-type"]
                else:
                    raw = await client.messages.with_raw_response.create(**REQUEST)
                    message = await raw.parse()
                    content_type = raw.headers["content-type"]
    return message.model_dump(), types, content_type, processor


async def test_the_upstream_filter_re_envelopes_signs_and_translates_a_bedrock_stream(
    mock_server: tuple[MockProvider, str],
) -> None:
    provider, url = mock_server
    provider.clear_requests()
    # Deltas 0.2 s apart, so that they reach Envoy (and the processor) as pieces of their own.
    provider.set_behaviour(MOCK_AWS_ACCESS_KEY_ID, Behaviour(chunks=3, chunk_interval_secs=0.2))
    try:
        message, types, content_type, processor = await _through_envoy(url, stream=True)
    finally:
        provider.reset_behaviours()

    # (a)-(c): the mock received the path, body and signature the processor set, and the
    # signature over that body verified (the key is the access key id the mock checked).
    [call] = provider.requests
    [(path, body)] = processor.sent
    assert call.path == path == f"/model/{MODEL_ID}/invoke-with-response-stream"
    assert call.key == MOCK_AWS_ACCESS_KEY_ID
    assert call.body == body
    assert len(body) != len(json.dumps(REQUEST))  # another length than the client's
    sent = json.loads(body)
    assert "model" not in sent
    assert "stream" not in sent
    assert sent["anthropic_version"] == "bedrock-2023-05-31"
    assert "x-api-key" not in call.headers

    # (d): the binary event-stream reached the SDK as Anthropic's SSE, piece by piece.
    assert content_type.startswith("text/event-stream")
    assert types[0] == "message_start"
    assert types[-1] == "message_stop"
    assert message["content"][0]["text"]
    assert message["stop_reason"] == "end_turn"
    assert any(bytes_in != bytes_out for bytes_in, bytes_out in processor.pieces)
    assert sum(bytes_out for _, bytes_out in processor.pieces) > 0
    assert len(processor.pieces) > 3  # piece by piece, not one buffered body


async def test_a_bedrock_json_answer_passes_through_the_same_processor(
    mock_server: tuple[MockProvider, str],
) -> None:
    provider, url = mock_server
    provider.clear_requests()
    message, _, _, processor = await _through_envoy(url, stream=False)
    [call] = provider.requests
    assert call.path == f"/model/{MODEL_ID}/invoke"
    assert call.key == MOCK_AWS_ACCESS_KEY_ID
    assert message["content"][0]["text"]
    assert processor.pieces  # the JSON answer's body reached the processor, and was left as is


async def test_without_allow_all_routing_the_authority_is_dropped_and_the_signature_fails(
    mock_server: tuple[MockProvider, str],
) -> None:
    """`:authority` is a routing header: without `mutation_rules.allow_all_routing` Envoy
    drops its mutation silently, sends the client's host, and the
    signature, made over the upstream's host, does not match."""
    provider, url = mock_server
    provider.clear_requests()
    with pytest.raises(anthropic.PermissionDeniedError) as info:
        await _through_envoy(url, stream=True, allow_all_routing=False)
    assert "signature we calculated does not match" in str(info.value)
    assert provider.requests == []  # refused before the model


@pytest.mark.parametrize("stream", [False, True])
async def test_envoys_aws_request_signing_signs_the_body_the_processor_rewrote(
    mock_server: tuple[MockProvider, str], stream: bool
) -> None:
    """Envoy's `aws_request_signing` in the upstream chain after the processor (which
    re-envelopes but does not sign) signs the rewritten path, host and body: the mock verified
    the signature. It signs with one credential per filter (per cluster), set in Envoy's
    config, which is why switchyard signs in the processor instead (see docs/envoy.md)."""
    provider, url = mock_server
    provider.clear_requests()
    message, _, _, processor = await _through_envoy(url, stream=stream, envoy_signs=True)
    [call] = provider.requests
    [(path, body)] = processor.sent
    assert call.path == path
    assert call.body == body
    assert call.key == MOCK_AWS_ACCESS_KEY_ID  # the signature Envoy made verified
    assert message["content"][0]["text"]
