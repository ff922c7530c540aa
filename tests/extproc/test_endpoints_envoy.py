"""The other endpoints clients call, through a real Envoy running examples/envoy/envoy.yaml with
the processor and the mock provider, called with the official SDKs: the models lists answered by
the processor, count_tokens routed and failed over between the cluster's keys, and the wire's
404 for any other `/v1/` path (never Envoy's or the provider's plain text)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anthropic
import httpx
import openai
import pytest
import pytest_asyncio

from envoy_rig import Rig, StartRig
from switchyard_mw.testing import Behaviour, MockProvider

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration]
KEYS = {"KEY_A": "key-a", "KEY_B": "key-b"}
MODELS = ["claude-opus-5", "claude-haiku-5", "gpt-5"]
MESSAGES: list[anthropic.types.MessageParam] = [{"role": "user", "content": "How many tokens?"}]


def config_text(mock_url: str) -> str:
    account = f"""
base_url = "{mock_url}"
models = ["claude-opus-5", "claude-haiku-5", "gpt-5"]
timeout_secs = 7
default_max_tokens = 128000
failure_threshold = 100
envoy_cluster = "mock"
"""
    return f"""
[llm_clients.key-a]
api_key_env = "KEY_A"
auth = "x-api-key"
priority = 0
{account}
[llm_clients.key-b]
api_key_env = "KEY_B"
auth = "bearer"
priority = 1
{account}"""


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def rig(start_rig: StartRig) -> AsyncIterator[Rig]:
    async with start_rig(config_text, KEYS) as rig:
        yield rig


@pytest.fixture
def provider(rig: Rig) -> MockProvider:
    rig.mock.reset()
    return rig.mock


async def test_both_sdks_list_the_models_from_the_processor(
    rig: Rig, provider: MockProvider
) -> None:
    gpt = openai.AsyncOpenAI(base_url=f"{rig.envoy_url}/v1", api_key="caller", max_retries=0)
    assert [m.id async for m in gpt.models.list()] == MODELS
    assert (await gpt.models.retrieve("gpt-5")).owned_by == "switchyard"
    claude = anthropic.AsyncAnthropic(base_url=rig.envoy_url, api_key="caller", max_retries=0)
    assert [m.id async for m in claude.models.list(limit=1)] == MODELS  # three pages
    page = await claude.models.list(limit=2)
    assert (page.has_more, page.first_id, page.last_id) == (True, "claude-opus-5", "claude-haiku-5")
    assert (await claude.models.retrieve("claude-haiku-5")).type == "model"
    with pytest.raises(anthropic.NotFoundError):
        await claude.models.retrieve("claude-nope")
    assert provider.requests == []  # never routed to the provider


async def test_count_tokens_is_routed_and_fails_over_inside_envoy(
    rig: Rig, provider: MockProvider
) -> None:
    claude = anthropic.AsyncAnthropic(base_url=rig.envoy_url, api_key="caller", max_retries=0)
    raw = await claude.messages.with_raw_response.count_tokens(
        model="claude-haiku-5", messages=MESSAGES
    )
    (record,) = provider.requests
    assert (record.path, record.key) == ("/v1/messages/count_tokens", "key-a")
    assert (await raw.parse()).input_tokens == max(1, len(record.body) // 4)
    # The account's timeout, not the 600 s its default_max_tokens gives a Messages call.
    assert raw.headers["x-switchyard-deadline-ms"] == "7000"
    provider.reset()
    provider.set_behaviour("key-a", Behaviour(status=503))
    raw = await claude.messages.with_raw_response.count_tokens(
        model="claude-opus-5", messages=MESSAGES
    )
    assert (await raw.parse()).input_tokens > 0
    assert [(r.path, r.key) for r in provider.requests] == [
        ("/v1/messages/count_tokens", "key-a"),
        ("/v1/messages/count_tokens", "key-b"),
    ]
    assert raw.headers["x-switchyard-account"] == "key-b"


async def test_any_other_v1_path_is_the_wires_json_404(rig: Rig, provider: MockProvider) -> None:
    claude = anthropic.AsyncAnthropic(base_url=rig.envoy_url, api_key="caller", max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as caught_a:
        await claude.get("/v1/files", cast_to=object)
    assert caught_a.value.body == {  # type: ignore[comparison-overlap]
        "type": "error",
        "error": {"type": "not_found_error", "message": "Invalid URL (GET /v1/files)"},
    }
    gpt = openai.AsyncOpenAI(base_url=f"{rig.envoy_url}/v1", api_key="caller", max_retries=0)
    with pytest.raises(openai.NotFoundError) as caught_o:
        await gpt.post("/embeddings", cast_to=object, body={"model": "gpt-5", "input": "x"})
    assert caught_o.value.code == "unknown_url"
    async with httpx.AsyncClient(base_url=rig.envoy_url) as http:
        response = await http.get("/v1/messages")
        assert response.status_code == 404
        assert response.headers["content-type"] == "application/json"
        assert response.json()["error"]["type"] == "not_found_error"
        # Outside /v1/ the request passes through to the default route (the mock's own 404).
        outside = await http.get("/elsewhere")
        assert outside.status_code == 404
        assert outside.json()["error"]["message"] == "Invalid URL (GET /elsewhere)"
    assert provider.requests == []
