"""Hostile but plausible request bodies through a real Envoy and the ext_proc processor.

The example envoy.yaml as shipped, the processor on each transport, the mock provider as the
upstream and the judge. Each body gets a clean answer in the wire's format from the processor
(an immediate response) or is judged and routed; none fails the ext_proc stream (which Envoy
would answer with a 5xx).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import anthropic
import httpx
import openai
import pytest
import pytest_asyncio

from envoy_rig import StartRig
from switchyard_mw.testing import Behaviour, MockProvider

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration]
KEYS = {"KEY_A": "key-a", "JUDGE_KEY": "judge-key"}


def config_text(mock_url: str) -> str:
    return f"""
[llm_clients.key-a]
base_url = "{mock_url}"
api_key_env = "KEY_A"
models = ["claude-opus-5", "claude-haiku-5", "gpt-5"]
envoy_cluster = "mock"

[llm_clients.judge]
base_url = "{mock_url}"
api_key_env = "JUDGE_KEY"
models = ["gpt-judge"]

[routes.auto]
classifier = "llm"
judge = "judge"
judge_model = "gpt-judge"
judge_deadline_ms = 1500
choices = {{ simple = "claude-haiku-5", complex = "claude-opus-5" }}
fallback = "claude-opus-5"
"""


@pytest.fixture(autouse=True)
def judge_answers(mock_server: tuple[MockProvider, str]) -> None:
    mock_server[0].reset()
    mock_server[0].set_behaviour(KEYS["JUDGE_KEY"], Behaviour(reply="simple"))


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def envoy(start_rig: StartRig) -> AsyncIterator[str]:
    """Envoy's URL, with the processor behind it on `transport`."""
    async with start_rig(config_text, KEYS) as rig:
        yield rig.envoy_url


def nested(depth: int) -> bytes:
    content = "[" * depth + "]" * depth
    return (
        f'{{"model":"auto","max_tokens":5,"messages":[{{"role":"user","content":{content}}}]}}'
    ).encode()


async def test_nested_bodies_are_judged_or_refused_never_a_5xx(envoy: str) -> None:
    seen: dict[int, str] = {}
    async with httpx.AsyncClient(base_url=envoy, timeout=10) as client:
        for depth in [*range(900, 1011), 5000]:  # every depth near the limit
            reply = await client.post(
                "/v1/messages", content=nested(depth), headers={"content-type": "application/json"}
            )
            if reply.status_code == 400:
                assert reply.json()["error"]["type"] == "invalid_request_error", depth
                assert "nests too deeply" in reply.json()["error"]["message"]
                seen[depth] = "400"
                continue
            assert reply.status_code == 200, (depth, reply.status_code, reply.text[:200])
            assert reply.headers["x-switchyard-route"] == "judge:simple", depth
            assert reply.headers["x-switchyard-model"] == "claude-haiku-5", depth
            seen[depth] = "judged"
    # One limit: every depth up to it is judged, every depth past it refused.
    judged = [depth for depth, outcome in seen.items() if outcome == "judged"]
    refused = [depth for depth, outcome in seen.items() if outcome == "400"]
    assert judged
    assert refused
    assert max(judged) < min(refused)


async def test_a_model_no_account_serves_is_a_404_each_sdk_raises(
    envoy: str, mock_server: tuple[MockProvider, str]
) -> None:
    claude = anthropic.AsyncAnthropic(base_url=envoy, api_key="caller", max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as refused:
        await claude.messages.create(
            model="no-such-model", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
        )
    assert "`no-such-model`" in refused.value.message
    gpt = openai.AsyncOpenAI(base_url=f"{envoy}/v1", api_key="caller", max_retries=0)
    with pytest.raises(openai.NotFoundError) as missing:
        await gpt.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}]
        )
    assert missing.value.code == "model_not_found"
    assert mock_server[0].requests == []  # nothing reached the provider's default route either


@pytest.mark.parametrize("model", ["claude-opus-5\r\nx-injected: 1", "gpt-5\u0000", "m" * 100_000])
async def test_a_model_name_unfit_for_a_header_is_a_400(
    envoy: str, mock_server: tuple[MockProvider, str], model: str
) -> None:
    gpt = openai.AsyncOpenAI(base_url=f"{envoy}/v1", api_key="caller", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        await gpt.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
    assert refused.value.code == "invalid_request_error"
    assert sum(len(k) + len(v) for k, v in refused.value.response.headers.items()) < 2000
    assert mock_server[0].requests == []
    reply = await gpt.chat.completions.create(
        model="gpt-5", messages=[{"role": "user", "content": "hi"}]
    )
    assert reply.choices[0].message.content
