"""The failures a provider really has, against the example's own config as shipped
(`examples/switchyard.toml`): the shape users deploy, one provider account (a key) serving
several models, a second key of the same provider, a cloud that knows the models by its own
names, and a chain from claude-opus-5 to claude-haiku-5.

Each scenario names what the client must get: `pass` (a whole answer), or `safe` (the
documented error, at once, never a provider's refusal of its own key dressed as the client's).
The gateway runs under uvicorn with the official SDKs as clients (no retries of their own, so
what they see is what the gateway answered); each test starts a fresh gateway, so no cooling
leaks from one scenario into the next.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from servers import ROOT, example_gateway, serve_in_thread
from switchyard_mw.testing import Behaviour, MockProvider

pytestmark = pytest.mark.integration

ENV = {"MOCK_KEY_A": "key-a", "MOCK_KEY_B": "key-b", "MOCK_JUDGE_KEY": "key-j"}
SHIPPED = ROOT / "examples" / "switchyard.toml"
OPUS_NAMES = ["claude-opus-5", "vendor.claude-opus-5-v1:0"]
"""claude-opus-5 by every name an account of the example knows it by."""
MESSAGES: Any = [{"role": "user", "content": "Hello"}]
WHOLE = "Hello from the mock provider."


@pytest.fixture(scope="module")
def mock() -> Iterator[MockProvider]:
    provider = MockProvider()
    with serve_in_thread(provider) as url:
        provider.url = url  # type: ignore[attr-defined]
        yield provider


@pytest.fixture
def gateway(mock: MockProvider, tmp_path: Path) -> Iterator[str]:
    mock.reset()
    text = SHIPPED.read_text().replace("http://127.0.0.1:9100", mock.url)  # type: ignore[attr-defined]
    with example_gateway(text, tmp_path, ENV) as url:
        yield url


def claude(gateway: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway, api_key="client-key", max_retries=0)


def ask(gateway: str, model: str = "claude-opus-5", *, stream: bool = False) -> tuple[str, Any]:
    """One Messages request; the text the SDK read, and the answer's headers."""
    client = claude(gateway)
    if stream:
        with client.messages.stream(model=model, max_tokens=100, messages=MESSAGES) as events:
            text = "".join(events.text_stream)
            return text, events.response.headers
    raw = client.messages.with_raw_response.create(model=model, max_tokens=100, messages=MESSAGES)
    message = raw.parse()
    assert message.content[0].type == "text"
    return message.content[0].text, raw.headers


def accounts_page(gateway: str) -> dict[str, Any]:
    page: dict[str, Any] = httpx.get(f"{gateway}/switchyard/accounts").json()
    return page


STREAMS = pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])


# --- pass: the client gets a whole answer ---------------------------------------------------


@STREAMS
def test_the_primary_key_fails_with_500_the_second_key_answers(
    gateway: str, mock: MockProvider, stream: bool
) -> None:
    mock.set_behaviour("key-a", Behaviour(status=500))
    text, headers = ask(gateway, stream=stream)
    assert text == WHOLE
    assert (headers["x-switchyard-account"], headers["x-switchyard-attempts"]) == ("mock-b", "2")


def test_a_429_on_the_primary_goes_to_the_second_key_at_once(
    gateway: str, mock: MockProvider
) -> None:
    mock.set_behaviour("key-a", Behaviour(status=429))
    started = time.monotonic()
    text, headers = ask(gateway)
    assert text == WHOLE
    assert headers["x-switchyard-account"] == "mock-b"
    assert time.monotonic() - started < 1.0  # another account at once, before any wait


def test_a_connection_reset_before_the_headers_fails_over(gateway: str, mock: MockProvider) -> None:
    mock.set_behaviour("key-a", Behaviour(fail="reset_before_headers"))
    text, headers = ask(gateway)
    assert text == WHOLE
    assert headers["x-switchyard-account"] == "mock-b"


def test_opus_overloaded_on_both_keys_the_cloud_serves_it(gateway: str, mock: MockProvider) -> None:
    for key in ("key-a", "key-b"):
        mock.set_behaviour(key, Behaviour(status=529, status_models=["claude-opus-5"]))
    text, headers = ask(gateway)
    assert text == WHOLE
    assert headers["x-switchyard-model"] == "claude-opus-5"
    assert headers["x-switchyard-account"] == "mock-cloud"


@STREAMS
def test_opus_down_on_every_account_the_first_request_gets_haiku_from_the_same_key(
    gateway: str, mock: MockProvider, stream: bool
) -> None:
    """The row the failover benchmark failed with the example's settings: the chain's model
    sits on the account that just failed for opus, and must be tried there."""
    for key in ("key-a", "key-b"):
        mock.set_behaviour(key, Behaviour(status=529, status_models=OPUS_NAMES))
    text, headers = ask(gateway, stream=stream)
    assert text == WHOLE
    assert headers["x-switchyard-model"] == "claude-haiku-5"
    assert headers["x-switchyard-route"] == "fallback:unavailable"
    assert headers["x-switchyard-account"] == "mock-a"
    assert [(r.key, r.model) for r in mock.requests][-1] == ("key-a", "claude-haiku-5")


def test_a_stream_cut_mid_way_reaches_the_client_whole(gateway: str, mock: MockProvider) -> None:
    mock.set_behaviour(
        "key-a", Behaviour(chunks=6, stall_after_chunks=2, fail="reset_mid_stream", times=1)
    )
    text, headers = ask(gateway, stream=True)
    assert text == WHOLE
    assert headers["x-switchyard-model"] == "claude-opus-5"


def test_the_openai_wire_fails_over_too(gateway: str, mock: MockProvider) -> None:
    mock.set_behaviour("key-a", Behaviour(status=503))
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="client-key", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(model="gpt-5", messages=MESSAGES)
    assert raw.parse().choices[0].message.content == WHOLE
    assert raw.headers["x-switchyard-account"] == "mock-b"


# --- safe: the documented error, at once ------------------------------------------------------


def test_every_key_refused_the_first_request_gets_the_credentials_503(
    gateway: str, mock: MockProvider
) -> None:
    for key in ("key-a", "key-b"):
        mock.set_behaviour(key, Behaviour(status=401))
    started = time.monotonic()
    with pytest.raises(anthropic.APIStatusError) as info:
        ask(gateway)
    assert time.monotonic() - started < 2.0
    assert info.value.status_code == 503  # never the provider's 401: the client's key is fine
    assert info.value.response.headers["x-should-retry"] == "false"
    assert "retry-after" not in info.value.response.headers
    assert "credentials" in info.value.message


def test_everything_down_is_a_503_with_the_earliest_recovery(
    gateway: str, mock: MockProvider
) -> None:
    for key in ("key-a", "key-b"):
        mock.set_behaviour(key, Behaviour(status=503))
    with pytest.raises(anthropic.APIStatusError) as info:
        ask(gateway)
    assert info.value.status_code in (502, 503)
    assert info.value.body is not None
    body: Any = info.value.body
    assert body["type"] == "error"


def test_a_prompt_too_long_for_opus_is_the_provider_s_400_not_a_smaller_model(
    gateway: str, mock: MockProvider
) -> None:
    """The example's chain says `on = ["unavailable"]`: haiku has no larger context."""
    for key in ("key-a", "key-b"):
        mock.set_behaviour(key, Behaviour(refuse="context_length"))
    with pytest.raises(anthropic.BadRequestError) as info:
        ask(gateway)
    assert "too long" in info.value.message
    assert all(r.model in OPUS_NAMES for r in mock.requests)
