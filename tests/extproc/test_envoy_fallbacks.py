"""Fallback chains through a real Envoy (examples/envoy/envoy.yaml) and the processor, with the
official SDKs: issue 35's rows 1 and 2, streams and not, on both processor transports.

Every account is on the one cluster the example routes to, so a fallback model's account is
one Envoy can retry on: the retry's request goes to the chain's model with the body
rewritten by the upstream-level filter (the example's retry filter buffers a retry's body).
A context-length refusal is read by the upstream-level filter (it asks for a 400's body) and
answered with the retry header, as a fault is.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import anthropic
import openai
import pytest
import pytest_asyncio

from envoy_rig import Rig, StartRig
from sdk_calls import OPENAI_WIRES, STREAMS, anthropic_call, openai_call
from switchyard_mw.testing import Behaviour, MockProvider

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration]
KEYS = {f"KEY_{n}": f"key-{n.lower()}" for n in "ABCDEFGH"}
OUT = Behaviour(status=503)
TOO_LONG = Behaviour(refuse="context_length")


def config_text(mock_url: str) -> str:
    def account(name: str, key: str, models: list[str], priority: int = 0) -> str:
        return (
            f'[llm_clients.{name}]\nbase_url = "{mock_url}"\napi_key_env = "KEY_{key}"\n'
            f'auth = "x-api-key"\nmodels = {models!r}\npriority = {priority}\n'
            'failure_threshold = 100\nenvoy_cluster = "mock"\n'.replace("'", '"')
        )

    return (
        account("x1", "A", ["gpt-x", "claude-opus-5"])
        + account("x2", "B", ["gpt-x", "claude-opus-5"], 1)
        + account("small", "C", ["gpt-x-mini", "claude-sonnet-5"])
        + account("short", "D", ["gpt-4k", "claude-haiku-5", "gpt-solo"])
        + account("short2", "F", ["gpt-4k", "claude-haiku-5", "gpt-solo"], 1)
        + account("long", "E", ["gpt-128k", "claude-opus-5-1m"])
        + account("shared", "G", ["gpt-shared", "gpt-shared-mini"])
        + account("broke", "H", ["gpt-broke", "gpt-broke-mini", "claude-broke"])
        + """
[fallbacks]
"gpt-shared" = ["gpt-shared-mini"]
"gpt-broke" = ["gpt-broke-mini"]
"gpt-x" = ["gpt-x-mini"]
"claude-opus-5" = { models = ["claude-sonnet-5"], on = ["unavailable", "context_length"] }
"gpt-4k" = { models = ["gpt-128k"], on = ["context_length"] }
"claude-haiku-5" = { models = ["claude-opus-5-1m"], on = ["context_length"] }
"""
    )


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def rig(start_rig: StartRig) -> AsyncIterator[Rig]:
    async with start_rig(config_text, KEYS) as rig:
        yield rig


@pytest_asyncio.fixture(loop_scope="module")
async def gateway(rig: Rig) -> str:
    rig.configure()
    return rig.envoy_url


def seen(mock: MockProvider) -> list[tuple[str, str | None]]:
    return [(r.key, r.model) for r in mock.requests]


def lengths_match(mock: MockProvider) -> bool:
    """Each rewritten body went with its own content-length."""
    return all(int(r.headers["content-length"]) == len(r.body) for r in mock.requests)


# --- row 1: nothing of the model can serve -----------------------------------------------------


@STREAMS
@OPENAI_WIRES
async def test_openai_every_account_503_the_chain_s_model_serves(
    rig: Rig, gateway: str, stream: bool, responses: bool
) -> None:
    rig.mock.set_behaviour("key-a", OUT)
    rig.mock.set_behaviour("key-b", OUT)
    text, headers = await openai_call(gateway, "gpt-x", stream, responses)
    assert text
    assert headers["x-switchyard-model"] == "gpt-x-mini"
    assert headers["x-switchyard-route"] == "fallback:unavailable"
    assert headers["x-switchyard-account"] == "small"
    assert seen(rig.mock) == [("key-a", "gpt-x"), ("key-b", "gpt-x"), ("key-c", "gpt-x-mini")]
    assert lengths_match(rig.mock)


@STREAMS
async def test_anthropic_every_account_503_the_chain_s_model_serves(
    rig: Rig, gateway: str, stream: bool
) -> None:
    rig.mock.set_behaviour("key-a", OUT)
    rig.mock.set_behaviour("key-b", OUT)
    text, headers = await anthropic_call(gateway, "claude-opus-5", stream)
    assert text
    assert headers["x-switchyard-model"] == "claude-sonnet-5"
    assert headers["x-switchyard-route"] == "fallback:unavailable"
    assert seen(rig.mock) == [
        ("key-a", "claude-opus-5"),
        ("key-b", "claude-opus-5"),
        ("key-c", "claude-sonnet-5"),
    ]


# --- row 2: a context-length refusal -----------------------------------------------------------


@STREAMS
@OPENAI_WIRES
async def test_openai_context_length_goes_to_the_larger_model(
    rig: Rig, gateway: str, stream: bool, responses: bool
) -> None:
    rig.mock.set_behaviour("key-d", TOO_LONG)
    rig.mock.set_behaviour("key-f", TOO_LONG)
    text, headers = await openai_call(gateway, "gpt-4k", stream, responses)
    assert text
    assert headers["x-switchyard-model"] == "gpt-128k"
    assert headers["x-switchyard-route"] == "fallback:context_length"
    assert seen(rig.mock) == [("key-d", "gpt-4k"), ("key-e", "gpt-128k")]
    assert lengths_match(rig.mock)


@STREAMS
async def test_anthropic_context_length_goes_to_the_larger_model(
    rig: Rig, gateway: str, stream: bool
) -> None:
    rig.mock.set_behaviour("key-d", TOO_LONG)
    text, headers = await anthropic_call(gateway, "claude-haiku-5", stream)
    assert text
    assert headers["x-switchyard-model"] == "claude-opus-5-1m"
    assert headers["x-switchyard-route"] == "fallback:context_length"
    assert seen(rig.mock) == [("key-d", "claude-haiku-5"), ("key-e", "claude-opus-5-1m")]


@STREAMS
@OPENAI_WIRES
async def test_openai_context_length_without_a_chain_is_the_400_once(
    rig: Rig, gateway: str, stream: bool, responses: bool
) -> None:
    rig.mock.set_behaviour("key-d", TOO_LONG)
    with pytest.raises(openai.BadRequestError) as info:
        await openai_call(gateway, "gpt-solo", stream, responses)
    assert info.value.code == "context_length_exceeded"
    assert info.value.response.headers["x-switchyard-account"] == "short"
    assert seen(rig.mock) == [("key-d", "gpt-solo")]  # short2 serves it too: never asked


@STREAMS
async def test_anthropic_context_length_when_the_larger_model_refuses_too(
    rig: Rig, gateway: str, stream: bool
) -> None:
    rig.mock.set_behaviour("key-d", TOO_LONG)
    rig.mock.set_behaviour("key-e", TOO_LONG)
    with pytest.raises(anthropic.BadRequestError) as info:
        await anthropic_call(gateway, "claude-haiku-5", stream)
    assert "prompt is too long" in info.value.message
    assert info.value.response.headers["x-switchyard-model"] == "claude-opus-5-1m"
    assert seen(rig.mock) == [("key-d", "claude-haiku-5"), ("key-e", "claude-opus-5-1m")]


# --- one account serving a model and its chain's model ------------------------------------------


@STREAMS
async def test_a_pair_that_fails_moves_to_the_chain_on_the_same_account(
    rig: Rig, gateway: str, stream: bool
) -> None:
    """What failed is the (account, model) pair: the very first request gets the chain's model
    from the same account, through Envoy's retry with the body rewritten."""
    rig.mock.set_behaviour("key-g", Behaviour(status=529, status_models=["gpt-shared"]))
    text, headers = await openai_call(gateway, "gpt-shared", stream, responses=False)
    assert text
    assert headers["x-switchyard-model"] == "gpt-shared-mini"
    assert headers["x-switchyard-route"] == "fallback:unavailable"
    assert headers["x-switchyard-account"] == "shared"
    assert seen(rig.mock) == [("key-g", "gpt-shared"), ("key-g", "gpt-shared-mini")]
    assert lengths_match(rig.mock)


@pytest.mark.parametrize(
    "model", ["gpt-broke", "claude-broke"], ids=["openai 429", "anthropic 400"]
)
async def test_a_billing_refusal_is_the_credential_503_never_the_chain_on_it(
    rig: Rig, gateway: str, model: str
) -> None:
    """OpenAI's 429 insufficient_quota, Anthropic's 400 "credit balance is too low": the
    processor reads the refusal's body, the account is out for every model, and the client
    gets the 503 that says its credentials were refused, not the provider's 429 or 400."""
    rig.mock.set_behaviour("key-h", Behaviour(refuse="billing"))
    if model == "gpt-broke":
        with pytest.raises(openai.InternalServerError) as gpt_error:
            await openai_call(gateway, model, False, responses=False)
        response = gpt_error.value.response
    else:
        with pytest.raises(anthropic.InternalServerError) as claude_error:
            await anthropic_call(gateway, model, False)
        response = claude_error.value.response
    assert response.status_code == 503
    body = response.json()
    assert "the upstream refused the credentials of every account" in body["error"]["message"]
    assert response.headers["x-should-retry"] == "false"
    assert seen(rig.mock) == [("key-h", model)]  # never the chain's model on it
