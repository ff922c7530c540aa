"""Provider model names through the example gateway (uvicorn), with the official SDKs.

Three accounts on the bundled mock provider: `direct` serves the public names as they are,
`vendor` knows `claude-opus-5` by a cloud's name, `azure` puts its deployment in the path. A
failover from `direct` to the others must send each account its own name and path, while the
client sees the public name in `x-switchyard-model`.
"""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import openai
import pytest

from servers import example_gateway, serve_in_thread
from switchyard_mw.testing import Behaviour, MockProvider

pytestmark = pytest.mark.integration

ENV = {"KEY_A": "key-a", "KEY_B": "key-b", "KEY_C": "key-c"}
VENDOR_NAME = "vendor.claude-opus-5-v1:0"
DEPLOYMENT = "gpt-x-deploy"


def config(mock_url: str) -> str:
    return f"""
[llm_clients.direct]
base_url = "{mock_url}"
api_key_env = "KEY_A"
auth = "x-api-key"
models = ["claude-opus-5", "gpt-x"]
failure_threshold = 100

[llm_clients.vendor]
base_url = "{mock_url}"
api_key_env = "KEY_B"
models = {{ "claude-opus-5" = "{VENDOR_NAME}" }}
priority = 1

[llm_clients.azure]
base_url = "{mock_url}"
api_key_env = "KEY_C"
models = {{ "gpt-x" = "{DEPLOYMENT}" }}
path = "/openai/deployments/{{model}}/chat/completions?api-version=2025-04-01"
priority = 1
"""


@pytest.fixture(scope="module")
def mock() -> Iterator[tuple[MockProvider, str]]:
    provider = MockProvider()
    with serve_in_thread(provider) as url:
        yield provider, url


@pytest.fixture(scope="module")
def gateway(
    mock: tuple[MockProvider, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    with example_gateway(config(mock[1]), tmp_path_factory.mktemp("gw"), ENV) as url:
        yield url


@pytest.fixture(autouse=True)
def clean_mock(mock: tuple[MockProvider, str]) -> None:
    mock[0].reset()


@pytest.mark.parametrize("stream", [False, True])
async def test_anthropic_failover_sends_each_account_its_own_name(
    gateway: str, mock: tuple[MockProvider, str], stream: bool
) -> None:
    provider, _ = mock
    provider.set_behaviour("key-a", Behaviour(status=503))
    client = anthropic.AsyncAnthropic(base_url=gateway, api_key="caller", max_retries=0)
    request = {
        "model": "claude-opus-5",
        "max_tokens": 50,
        "messages": [{"role": "user", "content": "hi"}],
    }
    if stream:
        async with client.messages.stream(**request) as events:  # type: ignore[arg-type]
            text = "".join([chunk async for chunk in events.text_stream])
            headers = events.response.headers
        assert text
    else:
        raw = await client.messages.with_raw_response.create(**request)  # type: ignore[arg-type]
        assert (await raw.parse()).content[0].type == "text"
        headers = raw.headers
    await client.close()
    assert headers["x-switchyard-model"] == "claude-opus-5"
    assert headers["x-switchyard-account"] == "vendor"
    assert headers["x-switchyard-attempts"] == "2"
    seen = [(r.key, r.path, r.model, r.stream) for r in provider.requests]
    assert seen == [
        ("key-a", "/v1/messages", "claude-opus-5", stream),
        ("key-b", "/v1/messages", VENDOR_NAME, stream),
    ]


@pytest.mark.parametrize("stream", [False, True])
async def test_openai_failover_to_a_deployment_path(
    gateway: str, mock: tuple[MockProvider, str], stream: bool
) -> None:
    provider, _ = mock
    provider.set_behaviour("key-a", Behaviour(status=503))
    client = openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key="caller", max_retries=0)
    raw = await client.chat.completions.with_raw_response.create(
        model="gpt-x", messages=[{"role": "user", "content": "hi"}], stream=stream
    )
    if stream:
        chunks = [c async for c in raw.parse()]  # type: ignore[union-attr]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        assert raw.parse().choices[0].message.content  # type: ignore[union-attr]
    await client.close()
    assert raw.headers["x-switchyard-model"] == "gpt-x"
    assert raw.headers["x-switchyard-account"] == "azure"
    seen = [(r.key, r.path, r.model) for r in provider.requests]
    assert seen == [
        ("key-a", "/v1/chat/completions", "gpt-x"),
        ("key-c", f"/openai/deployments/{DEPLOYMENT}/chat/completions", DEPLOYMENT),
    ]


async def test_the_account_that_renames_nothing_gets_the_clients_bytes(
    gateway: str, mock: tuple[MockProvider, str]
) -> None:
    provider, _ = mock
    client = openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key="caller", max_retries=0)
    raw = await client.chat.completions.with_raw_response.create(
        model="gpt-x", messages=[{"role": "user", "content": "hi"}]
    )
    await client.close()
    assert raw.headers["x-switchyard-account"] == "direct"
    (record,) = provider.requests
    assert (record.path, record.model) == ("/v1/chat/completions", "gpt-x")
