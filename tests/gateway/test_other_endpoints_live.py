"""The other endpoints clients call, through the example gateway under uvicorn, with the official
SDKs: `models.list()` and `models.retrieve()` on both, `messages.count_tokens()` forwarded with
failover and without deadline growth, and the wire's 404 for any other `/v1/` path.

The mock provider runs in this process; the gateway as `uvicorn examples.starlette_app:app`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from servers import example_gateway, serve_in_thread
from switchyard_mw.testing import Behaviour, MockProvider

pytestmark = pytest.mark.integration

ENV = {"KEY_A": "key-a", "KEY_B": "key-b", "JUDGE_KEY": "key-j"}
MODELS = ["claude-opus-5", "claude-haiku-5", "gpt-5", "gpt-judge", "auto"]
MESSAGES: list[anthropic.types.MessageParam] = [{"role": "user", "content": "How many tokens?"}]


def config(mock_url: str) -> str:
    # The default cap would grow a Messages call's deadline to 600 s: count_tokens keeps 7 s.
    return f"""
[llm_clients.a]
base_url = "{mock_url}"
api_key_env = "KEY_A"
auth = "x-api-key"
models = ["claude-opus-5", "claude-haiku-5"]
timeout_secs = 7
default_max_tokens = 128000
failure_threshold = 100

[llm_clients.b]
base_url = "{mock_url}"
api_key_env = "KEY_B"
models = {{ "claude-opus-5" = "vendor-opus-5", "gpt-5" = "gpt-5" }}
priority = 1
timeout_secs = 7
default_max_tokens = 128000

[llm_clients.judge]
base_url = "{mock_url}"
api_key_env = "JUDGE_KEY"
models = ["gpt-judge"]

[routes.auto]
classifier = "llm"
judge = "judge"
judge_model = "gpt-judge"
choices = {{ simple = "claude-haiku-5", complex = "claude-opus-5" }}
fallback = "claude-opus-5"
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


@pytest.fixture
def provider(mock: tuple[MockProvider, str]) -> MockProvider:
    mock[0].reset()
    return mock[0]


def claude(gateway: str) -> anthropic.AsyncAnthropic:
    # No key of the caller's is needed for the list; a key is sent as SDKs always do.
    return anthropic.AsyncAnthropic(base_url=gateway, api_key="caller", max_retries=0)


def gpt(gateway: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key="caller", max_retries=0)


async def test_openai_sdk_lists_and_retrieves_the_public_models(
    gateway: str, provider: MockProvider
) -> None:
    client = gpt(gateway)
    listed = [m async for m in client.models.list()]
    assert [m.id for m in listed] == MODELS  # public names: not b's "vendor-opus-5"
    assert {(m.object, m.owned_by, m.created) for m in listed} == {("model", "switchyard", 0)}
    model = await client.models.retrieve("gpt-5")
    assert (model.id, model.object) == ("gpt-5", "model")
    with pytest.raises(openai.NotFoundError) as caught:
        await client.models.retrieve("vendor-opus-5")
    assert caught.value.code == "model_not_found"
    assert provider.requests == []  # answered from the config: no account called


async def test_anthropic_sdk_lists_every_page_and_retrieves(
    gateway: str, provider: MockProvider
) -> None:
    client = claude(gateway)
    listed = [m async for m in client.models.list(limit=2)]  # three pages, followed by the SDK
    assert [m.id for m in listed] == MODELS
    assert {(m.type, m.display_name == m.id, m.created_at.year) for m in listed} == {
        ("model", True, 1970)
    }
    first = await client.models.list(limit=2)
    assert (first.has_more, first.first_id, first.last_id) == (
        True,
        "claude-opus-5",
        "claude-haiku-5",
    )
    last = await client.models.list(limit=2, after_id="gpt-judge")
    assert ([m.id for m in last.data], last.has_more) == (["auto"], False)
    model = await client.models.retrieve("auto")
    assert (model.id, model.type) == ("auto", "model")
    with pytest.raises(anthropic.NotFoundError) as caught:
        await client.models.retrieve("nope")
    assert caught.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError):
        await client.models.list(limit=1001)
    assert provider.requests == []


async def test_count_tokens_is_forwarded_and_answers_as_anthropic_does(
    gateway: str, provider: MockProvider
) -> None:
    raw = await claude(gateway).messages.with_raw_response.count_tokens(
        model="claude-haiku-5", messages=MESSAGES
    )
    counted = await raw.parse()
    (record,) = provider.requests
    assert record.path == "/v1/messages/count_tokens"
    assert (record.key, record.model) == ("key-a", "claude-haiku-5")
    assert counted.input_tokens == max(1, len(record.body) // 4)  # the mock's count
    # The account's timeout, not the 600 s default_max_tokens = 128000 gives a Messages call.
    assert raw.headers["x-switchyard-deadline-ms"] == "7000"
    assert raw.headers["x-switchyard-account"] == "a"


async def test_count_tokens_fails_over_when_an_account_fails(
    gateway: str, provider: MockProvider
) -> None:
    provider.set_behaviour("key-a", Behaviour(status=500))
    raw = await claude(gateway).messages.with_raw_response.count_tokens(
        model="claude-opus-5", messages=MESSAGES
    )
    counted = await raw.parse()
    assert [(r.key, r.path) for r in provider.requests] == [
        ("key-a", "/v1/messages/count_tokens"),
        ("key-b", "/v1/messages/count_tokens"),
    ]
    assert provider.requests[1].model == "vendor-opus-5"  # b's own name for the model
    assert counted.input_tokens == max(1, len(provider.requests[1].body) // 4)
    assert raw.headers["x-switchyard-attempts"] == "2"
    assert raw.headers["x-switchyard-account"] == "b"
    assert raw.headers["x-switchyard-deadline-ms"] == "7000"


async def test_count_tokens_for_a_model_no_account_serves_is_the_wires_404(
    gateway: str, provider: MockProvider
) -> None:
    with pytest.raises(anthropic.NotFoundError) as caught:
        await claude(gateway).messages.count_tokens(model="claude-nope", messages=MESSAGES)
    assert caught.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    assert provider.requests == []


async def test_any_other_v1_path_is_a_json_404_the_sdks_raise(gateway: str) -> None:
    with pytest.raises(anthropic.NotFoundError) as caught_a:
        await claude(gateway).get("/v1/messages/batches", cast_to=object)
    assert caught_a.value.body == {  # type: ignore[comparison-overlap]
        "type": "error",
        "error": {"type": "not_found_error", "message": "Invalid URL (GET /v1/messages/batches)"},
    }
    with pytest.raises(openai.NotFoundError) as caught_o:
        await gpt(gateway).post("/files", cast_to=object, body={})
    assert caught_o.value.code == "unknown_url"
    async with httpx.AsyncClient(base_url=gateway) as http:
        for method, path, headers in [
            ("GET", "/v1/nope", {}),
            ("GET", "/v1/nope", {"anthropic-version": "2023-06-01"}),
            ("DELETE", "/v1/models/gpt-5", {}),
            ("GET", "/v1/chat/completions", {}),
        ]:
            response = await http.request(method, path, headers=headers)
            assert response.status_code == 404
            assert response.headers["content-type"] == "application/json"
            fields: dict[str, Any] = response.json()
            assert fields["error"]["message"] == f"Invalid URL ({method} {path})"
        # Outside /v1/ the app's own routing stands.
        assert (await http.get("/switchyard/health")).status_code == 200
