"""Fallback chains through the example gateway (uvicorn), with the official SDKs: issue 35's
first two rows, streams and not.

Row 1: every account of a model answers 503 -> the next model of its chain serves, and
`x-switchyard-model` / `x-switchyard-route` say which and why. Row 2: a context-length refusal
-> the chain's larger model; without a chain, the provider's 400 as it came, and no other
account of the same model is tried.
"""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import openai
import pytest

from sdk_calls import OPENAI_WIRES, STREAMS, anthropic_call, openai_call
from servers import example_gateway, serve_in_thread
from switchyard_mw.testing import Behaviour, MockProvider

pytestmark = pytest.mark.integration

ENV = {f"KEY_{n}": f"key-{n.lower()}" for n in "ABCDEF"}
OUT = Behaviour(status=503)
TOO_LONG = Behaviour(refuse="context_length")


def config(mock_url: str) -> str:
    def account(name: str, key: str, models: list[str], priority: int = 0) -> str:
        return (
            f'[llm_clients.{name}]\nbase_url = "{mock_url}"\napi_key_env = "KEY_{key}"\n'
            f'auth = "x-api-key"\nmodels = {models!r}\npriority = {priority}\n'
            "failure_threshold = 100\n".replace("'", '"')
        )

    return (
        account("x1", "A", ["gpt-x", "claude-opus-5"])
        + account("x2", "B", ["gpt-x", "claude-opus-5"], 1)
        + account("small", "C", ["gpt-x-mini", "claude-sonnet-5"])
        + account("short", "D", ["gpt-4k", "claude-haiku-5", "gpt-solo"])
        + account("short2", "F", ["gpt-4k", "claude-haiku-5", "gpt-solo"], 1)
        + account("long", "E", ["gpt-128k", "claude-opus-5-1m"])
        + """
[fallbacks]
"gpt-x" = ["gpt-x-mini"]
"claude-opus-5" = { models = ["claude-sonnet-5"], on = ["unavailable", "context_length"] }
"gpt-4k" = { models = ["gpt-128k"], on = ["context_length"] }
"claude-haiku-5" = { models = ["claude-opus-5-1m"], on = ["context_length"] }
"""
    )


@pytest.fixture(scope="module")
def mock() -> Iterator[MockProvider]:
    provider = MockProvider()
    with serve_in_thread(provider) as url:
        provider.url = url  # type: ignore[attr-defined]
        yield provider


@pytest.fixture(scope="module")
def gateway(mock: MockProvider, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url = mock.url  # type: ignore[attr-defined]
    with example_gateway(config(url), tmp_path_factory.mktemp("gw"), ENV) as gateway_url:
        yield gateway_url


@pytest.fixture(autouse=True)
def clean_mock(mock: MockProvider) -> None:
    mock.reset()


def seen(mock: MockProvider) -> list[tuple[str, str | None]]:
    return [(r.key, r.model) for r in mock.requests]


# --- row 1: nothing of the model can serve -----------------------------------------------------


@STREAMS
@OPENAI_WIRES
async def test_openai_every_account_503_the_chain_s_model_serves(
    gateway: str, mock: MockProvider, stream: bool, responses: bool
) -> None:
    mock.set_behaviour("key-a", OUT)
    mock.set_behaviour("key-b", OUT)
    text, headers = await openai_call(gateway, "gpt-x", stream, responses)
    assert text
    assert headers["x-switchyard-model"] == "gpt-x-mini"
    assert headers["x-switchyard-route"] == "fallback:unavailable"
    assert headers["x-switchyard-account"] == "small"
    assert headers["x-switchyard-attempts"] == "3"
    assert seen(mock) == [("key-a", "gpt-x"), ("key-b", "gpt-x"), ("key-c", "gpt-x-mini")]


@STREAMS
async def test_anthropic_every_account_503_the_chain_s_model_serves(
    gateway: str, mock: MockProvider, stream: bool
) -> None:
    mock.set_behaviour("key-a", OUT)
    mock.set_behaviour("key-b", OUT)
    text, headers = await anthropic_call(gateway, "claude-opus-5", stream)
    assert text
    assert headers["x-switchyard-model"] == "claude-sonnet-5"
    assert headers["x-switchyard-route"] == "fallback:unavailable"
    assert seen(mock) == [
        ("key-a", "claude-opus-5"),
        ("key-b", "claude-opus-5"),
        ("key-c", "claude-sonnet-5"),
    ]


async def test_a_healthy_model_stays_and_says_no_route(gateway: str, mock: MockProvider) -> None:
    text, headers = await openai_call(gateway, "gpt-x", False, False)
    assert text
    assert headers["x-switchyard-model"] == "gpt-x"
    assert "x-switchyard-route" not in headers
    assert seen(mock) == [("key-a", "gpt-x")]


async def test_when_the_chain_is_out_too_the_last_answer_is_the_503(
    gateway: str, mock: MockProvider
) -> None:
    for key in ("key-a", "key-b", "key-c"):
        mock.set_behaviour(key, OUT)
    with pytest.raises(openai.InternalServerError) as info:
        await openai_call(gateway, "gpt-x", False, False)
    assert info.value.status_code == 503
    assert seen(mock) == [("key-a", "gpt-x"), ("key-b", "gpt-x"), ("key-c", "gpt-x-mini")]


# --- row 2: a context-length refusal -----------------------------------------------------------


@STREAMS
@OPENAI_WIRES
async def test_openai_context_length_goes_to_the_larger_model(
    gateway: str, mock: MockProvider, stream: bool, responses: bool
) -> None:
    mock.set_behaviour("key-d", TOO_LONG)
    mock.set_behaviour("key-f", TOO_LONG)
    text, headers = await openai_call(gateway, "gpt-4k", stream, responses)
    assert text
    assert headers["x-switchyard-model"] == "gpt-128k"
    assert headers["x-switchyard-route"] == "fallback:context_length"
    assert headers["x-switchyard-attempts"] == "2"
    # never the refused model's other account: the prompt is as long there
    assert seen(mock) == [("key-d", "gpt-4k"), ("key-e", "gpt-128k")]


@STREAMS
async def test_anthropic_context_length_goes_to_the_larger_model(
    gateway: str, mock: MockProvider, stream: bool
) -> None:
    mock.set_behaviour("key-d", TOO_LONG)
    text, headers = await anthropic_call(gateway, "claude-haiku-5", stream)
    assert text
    assert headers["x-switchyard-model"] == "claude-opus-5-1m"
    assert headers["x-switchyard-route"] == "fallback:context_length"
    assert seen(mock) == [("key-d", "claude-haiku-5"), ("key-e", "claude-opus-5-1m")]


@STREAMS
@OPENAI_WIRES
async def test_openai_context_length_without_a_chain_is_the_400_once(
    gateway: str, mock: MockProvider, stream: bool, responses: bool
) -> None:
    mock.set_behaviour("key-d", TOO_LONG)
    with pytest.raises(openai.BadRequestError) as info:
        await openai_call(gateway, "gpt-solo", stream, responses)
    assert info.value.code == "context_length_exceeded"
    assert info.value.response.headers["x-switchyard-account"] == "short"
    assert seen(mock) == [("key-d", "gpt-solo")]  # short2 serves it too: never asked


@STREAMS
async def test_anthropic_context_length_when_the_larger_model_refuses_too(
    gateway: str, mock: MockProvider, stream: bool
) -> None:
    mock.set_behaviour("key-d", TOO_LONG)
    mock.set_behaviour("key-e", TOO_LONG)
    with pytest.raises(anthropic.BadRequestError) as info:
        await anthropic_call(gateway, "claude-haiku-5", stream)
    assert "prompt is too long" in info.value.message
    assert info.value.response.headers["x-switchyard-model"] == "claude-opus-5-1m"
    assert seen(mock) == [("key-d", "claude-haiku-5"), ("key-e", "claude-opus-5-1m")]
