"""The answer names the public model: through the example gateway (uvicorn), with the official
SDKs as clients and the mock provider's API, Bedrock and Vertex faces as the upstreams.

Each public name here is served by one account that knows it by another name: `vendor` (a
plain account, all three wires), `aws` (Bedrock, whose answers say `claude-opus-5`) and `gcp`
(Vertex, whose answers say `claude-opus-5@20260101`). What the SDK returns, JSON and every
stream event, must carry the name the client asked for; the provider's own identifying headers
stay behind, and its request id comes back as `x-switchyard-upstream-request-id` too.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from sdk_calls import responses_model_names
from servers import example_gateway, serve_in_thread
from switchyard_mw.testing import MockProvider
from vertex_accounts import service_account_file

pytestmark = pytest.mark.integration
pytest.importorskip("botocore")

from switchyard_mw.testing._bedrock_face import (  # noqa: E402
    MOCK_AWS_ACCESS_KEY_ID,
    MOCK_AWS_SECRET_ACCESS_KEY,
)

VENDOR_CLAUDE = "vendor.claude-opus-5-v1:0"
VENDOR_GPT = "gpt-x-prod"
BEDROCK_ID = "us.anthropic.claude-opus-5-v1:0"
VERTEX_NAME = "claude-opus-5@20260101"
PROVIDER_HEADERS = ("anthropic-organization-id", "openai-organization")


def config(mock_url: str, key_file: str) -> str:
    return f"""
[llm_clients.vendor]
base_url = "{mock_url}"
api_key_env = "KEY_V"
models = {{ "claude-opus-5" = "{VENDOR_CLAUDE}", "gpt-x" = "{VENDOR_GPT}" }}

[llm_clients.aws]
kind = "bedrock"
base_url = "{mock_url}"
bedrock = {{ region = "us-east-1" }}
models = {{ "opus-on-bedrock" = "{BEDROCK_ID}" }}

[llm_clients.gcp]
kind = "vertex"
base_url = "{mock_url}"
vertex = {{ project = "my-project", region = "us-east5", credentials_file = "{key_file}" }}
models = {{ "opus-on-vertex" = "{VERTEX_NAME}" }}
"""


@pytest.fixture(scope="module")
def mock() -> Iterator[tuple[MockProvider, str]]:
    provider = MockProvider(aws_credentials={MOCK_AWS_ACCESS_KEY_ID: MOCK_AWS_SECRET_ACCESS_KEY})
    with serve_in_thread(provider) as url:
        yield provider, url


@pytest.fixture(scope="module")
def gateway(
    mock: tuple[MockProvider, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    provider, url = mock
    tmp = tmp_path_factory.mktemp("gw")
    key_file = service_account_file(tmp_path_factory.mktemp("keys"), provider, url)
    env = {
        "KEY_V": "key-v",
        "AWS_ACCESS_KEY_ID": MOCK_AWS_ACCESS_KEY_ID,
        "AWS_SECRET_ACCESS_KEY": MOCK_AWS_SECRET_ACCESS_KEY,
        "AWS_SHARED_CREDENTIALS_FILE": str(Path(tmp) / "credentials"),
        "AWS_CONFIG_FILE": str(Path(tmp) / "config"),
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    with example_gateway(config(url, str(key_file)), tmp, env) as gw:
        yield gw


@pytest.fixture(autouse=True)
def clean_mock(mock: tuple[MockProvider, str]) -> None:
    mock[0].clear_requests()


def _no_provider_headers(headers: Any) -> None:
    names = {name.lower() for name in headers}
    assert not {n for n in names if n.startswith(("x-amzn-", "x-goog-"))}
    assert not names & set(PROVIDER_HEADERS)


async def _messages(gateway: str, model: str, *, stream: bool) -> tuple[list[str], Any]:
    """Every model name the Anthropic SDK returned (a stream: `message_start`'s and the final
    message's), and the headers."""
    client = anthropic.AsyncAnthropic(base_url=gateway, api_key="caller", max_retries=0)
    request: dict[str, Any] = {
        "model": model,
        "max_tokens": 50,
        "messages": [{"role": "user", "content": "hi"}],
    }
    try:
        if stream:
            async with client.messages.stream(**request) as events:
                seen = [e.message.model async for e in events if e.type == "message_start"]
                final = await events.get_final_message()
                return [*seen, final.model], events.response.headers
        raw = await client.messages.with_raw_response.create(**request)
        return [(await raw.parse()).model], raw.headers
    finally:
        await client.close()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("model", "account", "provider_name"),
    [
        ("claude-opus-5", "vendor", VENDOR_CLAUDE),
        ("opus-on-bedrock", "aws", BEDROCK_ID),
        ("opus-on-vertex", "gcp", VERTEX_NAME),
    ],
)
async def test_the_anthropic_sdk_gets_the_public_name_from_every_account_kind(
    gateway: str,
    mock: tuple[MockProvider, str],
    stream: bool,
    model: str,
    account: str,
    provider_name: str,
) -> None:
    names, headers = await _messages(gateway, model, stream=stream)
    assert names == ([model, model] if stream else [model])
    assert headers["x-switchyard-account"] == account
    assert mock[0].requests[-1].model == provider_name  # the provider got its own name
    _no_provider_headers(headers)


async def test_the_providers_request_id_comes_back_beside_its_own_header(gateway: str) -> None:
    _, headers = await _messages(gateway, "claude-opus-5", stream=False)
    assert headers["request-id"].startswith("req_")  # the SDK's `_request_id`, as it was
    assert headers["x-switchyard-upstream-request-id"] == headers["request-id"]
    _, bedrock = await _messages(gateway, "opus-on-bedrock", stream=True)
    assert len(bedrock["x-switchyard-upstream-request-id"]) == 36  # Bedrock's x-amzn-requestid


def _openai(gateway: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key="caller", max_retries=0)


@pytest.mark.parametrize("stream", [False, True])
async def test_the_openai_sdk_gets_the_public_name_in_chat_completions(
    gateway: str, mock: tuple[MockProvider, str], stream: bool
) -> None:
    client = _openai(gateway)
    raw = await client.chat.completions.with_raw_response.create(
        model="gpt-x",
        messages=[{"role": "user", "content": "hi"}],
        stream=stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
    )
    if stream:
        names = [chunk.model async for chunk in raw.parse()]  # type: ignore[union-attr]
        assert len(names) > 2
    else:
        names = [raw.parse().model]  # type: ignore[union-attr]
    await client.close()
    assert set(names) == {"gpt-x"}
    assert mock[0].requests[-1].model == VENDOR_GPT
    assert raw.headers["x-switchyard-upstream-request-id"] == raw.headers["x-request-id"]
    _no_provider_headers(raw.headers)


@pytest.mark.parametrize("stream", [False, True])
async def test_the_openai_sdk_gets_the_public_name_in_responses(
    gateway: str, mock: tuple[MockProvider, str], stream: bool
) -> None:
    client = _openai(gateway)
    names = await responses_model_names(client, "gpt-x", stream)
    await client.close()
    assert set(names) == {"gpt-x"}
    assert mock[0].requests[-1].model == VENDOR_GPT
