"""The answer names the public model behind a real Envoy (examples/envoy/envoy.yaml) and the
processor, with the official SDKs as clients.

`vendor` knows `claude-opus-5` and `gpt-x` by its own names, on its first attempt and on Envoy's
retry after `direct` failed; the answer's `model`, JSON (BUFFERED, and STREAMED past 512 KiB)
and every stream event of all three wires, is the public name, and the provider's own
organization header does not reach the client.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
import pytest_asyncio

from envoy_rig import Rig, StartRig
from sdk_calls import responses_model_names
from switchyard_mw.testing import Behaviour

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration]
KEYS = {"KEY_A": "key-a", "KEY_B": "key-b"}
VENDOR_CLAUDE = "vendor.claude-opus-5-v1:0"
VENDOR_GPT = "gpt-x-prod"


def config_text(mock_url: str, *, direct_first: bool) -> str:
    return f"""
[llm_clients.direct]
base_url = "{mock_url}"
api_key_env = "KEY_A"
auth = "x-api-key"
models = ["claude-opus-5", "gpt-x"]
failure_threshold = 100
priority = {0 if direct_first else 2}
envoy_cluster = "mock"

[llm_clients.vendor]
base_url = "{mock_url}"
api_key_env = "KEY_B"
models = {{ "claude-opus-5" = "{VENDOR_CLAUDE}", "gpt-x" = "{VENDOR_GPT}" }}
priority = 1
envoy_cluster = "mock"
"""


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def rig(start_rig: StartRig) -> AsyncIterator[Rig]:
    async with start_rig(config_text, KEYS, options={"direct_first": False}) as rig:
        yield rig


@pytest.fixture(autouse=True)
def vendor_first(rig: Rig) -> None:
    rig.configure(direct_first=False)


async def _messages(rig: Rig, *, stream: bool, **extra: Any) -> tuple[list[str], Any]:
    client = anthropic.AsyncAnthropic(base_url=rig.envoy_url, api_key="caller", max_retries=0)
    request: dict[str, Any] = {
        "model": "claude-opus-5",
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
        message = await raw.parse()
        return [message.model, *(b.text for b in message.content if b.type == "text")], raw.headers
    finally:
        await client.close()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("failover", [False, True])
async def test_the_anthropic_sdk_gets_the_public_name(
    rig: Rig, stream: bool, failover: bool
) -> None:
    if failover:  # `direct` first, refusing: Envoy's retry goes to `vendor`
        rig.configure(direct_first=True)
        rig.mock.set_behaviour("key-a", Behaviour(status=503))
    names, headers = await _messages(rig, stream=stream)
    assert names[: 2 if stream else 1] == ["claude-opus-5"] * (2 if stream else 1)
    assert headers["x-switchyard-account"] == "vendor"
    assert rig.mock.requests[-1].model == VENDOR_CLAUDE
    assert "anthropic-organization-id" not in headers
    assert headers["x-switchyard-upstream-request-id"] == headers["request-id"]


async def test_a_json_answer_read_whole_gets_its_new_length(rig: Rig) -> None:
    body = {
        "model": "claude-opus-5",
        "max_tokens": 50,
        "messages": [{"role": "user", "content": "hi"}],
    }
    async with httpx.AsyncClient(base_url=rig.envoy_url, timeout=10) as http:
        response = await http.post("/v1/messages", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == "claude-opus-5"
    declared = response.headers.get("content-length")
    assert declared is None or int(declared) == len(response.content)


async def test_a_json_answer_too_long_to_hold_is_renamed_as_it_passes(rig: Rig) -> None:
    text = "long answer " * 60_000  # 720 KB: past the 512 KiB asked for whole
    rig.mock.set_behaviour("key-b", Behaviour(reply=text))
    names, _ = await _messages(rig, stream=False)
    assert names == ["claude-opus-5", text]


def _openai(rig: Rig) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{rig.envoy_url}/v1", api_key="caller", max_retries=0)


@pytest.mark.parametrize("stream", [False, True])
async def test_the_openai_sdk_gets_the_public_name_in_chat_completions(
    rig: Rig, stream: bool
) -> None:
    client = _openai(rig)
    raw = await client.chat.completions.with_raw_response.create(
        model="gpt-x", messages=[{"role": "user", "content": "hi"}], stream=stream
    )
    if stream:
        names = [chunk.model async for chunk in raw.parse()]  # type: ignore[union-attr]
        assert len(names) > 2
    else:
        names = [raw.parse().model]  # type: ignore[union-attr]
    await client.close()
    assert set(names) == {"gpt-x"}
    assert rig.mock.requests[-1].model == VENDOR_GPT
    assert "openai-organization" not in raw.headers


@pytest.mark.parametrize("stream", [False, True])
async def test_the_openai_sdk_gets_the_public_name_in_responses(rig: Rig, stream: bool) -> None:
    client = _openai(rig)
    names = await responses_model_names(client, "gpt-x", stream)
    await client.close()
    assert set(names) == {"gpt-x"}
    assert rig.mock.requests[-1].model == VENDOR_GPT
