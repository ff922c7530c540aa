"""Throttle hold over real sockets: the example gateway under uvicorn, the mock provider, the
official SDKs with their own retries."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from servers import example_gateway, metric_value, serve_in_thread
from switchyard_mw.testing import Behaviour, MockProvider

pytestmark = pytest.mark.integration

MESSAGES: Any = [{"role": "user", "content": "Say hello"}]
FORMS = {
    "retry-after": {"retry-after": "20"},
    "retry-after-ms": {"retry-after-ms": "20000"},
    "anthropic-reset": {  # the exhausted limit resets later than retry-after: capped at 30 s
        "retry-after": "1",
        "anthropic-ratelimit-requests-remaining": "0",
        "anthropic-ratelimit-requests-reset": "2100-01-01T00:00:00Z",
    },
    "openai-reset": {"x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "20s"},
}
# The "multi" account serves one model per header form (each test holds its own) and one more.
HELD_MODELS = str([f"held-{form}" for form in FORMS] + ["never-held"]).replace("'", '"')


def _config(mock_url: str) -> str:
    sections = []
    for name, model, priority in (
        ("first", "m", 0),
        ("second", "m", 1),
        ("solo", "solo", 0),
        ("multi", "multi-a", 0),
    ):
        models = HELD_MODELS if name == "multi" else f'["{model}"]'
        sections.append(f"""
[llm_clients.{name}]
base_url = "{mock_url}"
api_key_env = "KEY_{name.upper()}"
auth = "x-api-key"
models = {models}
priority = {priority}
max_throttle_secs = 30
""")
    return "".join(sections)


@pytest.fixture(scope="module")
def mock() -> Iterator[MockProvider]:
    provider = MockProvider()
    with serve_in_thread(provider) as url:
        provider.url = url  # type: ignore[attr-defined]
        yield provider


@pytest.fixture(scope="module")
def gateway(mock: MockProvider, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    keys = {f"KEY_{n.upper()}": f"key-{n}" for n in ("first", "second", "solo", "multi")}
    url: str = mock.url  # type: ignore[attr-defined]
    with example_gateway(_config(url), tmp_path_factory.mktemp("throttle"), keys) as gw:
        yield gw


@pytest.fixture(autouse=True)
def _fresh(mock: MockProvider) -> Iterator[None]:
    mock.reset()
    yield
    mock.reset()


def _account(gateway: str, name: str) -> dict[str, Any]:
    accounts = httpx.get(f"{gateway}/switchyard/accounts").json()["accounts"]
    (found,) = [a for a in accounts if a["name"] == name]
    assert isinstance(found, dict)
    return found


@pytest.mark.parametrize("form", FORMS)
async def test_a_held_account_is_skipped_by_the_next_request(
    gateway: str, mock: MockProvider, form: str
) -> None:
    model = f"held-{form}"
    assert model not in _account(gateway, "multi")["held_for_secs"]
    mock.set_behaviour("key-multi", Behaviour(status=429, headers=FORMS[form]))
    async with anthropic.AsyncAnthropic(base_url=gateway, api_key="x", max_retries=0) as client:
        with pytest.raises(anthropic.RateLimitError) as upstream:
            await client.messages.create(model=model, max_tokens=8, messages=MESSAGES)
        assert upstream.value.response.json()["error"]["type"] != "rate_limited"  # the mock's
        mock.clear_requests()
        # Held: switchyard answers the 429 itself, with the hold's end, and calls no upstream.
        with pytest.raises(anthropic.RateLimitError) as local:
            await client.messages.create(model=model, max_tokens=8, messages=MESSAGES)
        assert mock.requests == []
        assert local.value.response.json()["error"]["type"] == "rate_limited"
        assert 15 <= int(local.value.response.headers["retry-after"]) <= 30
        multi = _account(gateway, "multi")
        assert 15 < multi["held_for_secs"][model] <= 30
        assert (multi["state"], multi["consecutive_faults"]) == ("closed", 0)
        # The hold is for that model only: the same account serves its other model.
        mock.reset_behaviours()
        other = await client.messages.with_raw_response.create(
            model="never-held", max_tokens=8, messages=MESSAGES
        )
    assert other.headers["x-switchyard-account"] == "multi"


async def test_the_other_account_serves_while_one_is_held(gateway: str, mock: MockProvider) -> None:
    mock.set_behaviour("key-first", Behaviour(status=429, headers={"retry-after": "2"}))
    async with openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key="x", max_retries=0) as client:
        first = await client.chat.completions.with_raw_response.create(model="m", messages=MESSAGES)
        assert first.headers["x-switchyard-attempts"] == "2"
        mock.reset_behaviours()
        second = await client.chat.completions.with_raw_response.create(
            model="m", messages=MESSAGES
        )
    assert second.headers["x-switchyard-attempts"] == "1"
    assert second.headers["x-switchyard-account"] == "second"
    assert [r.key for r in mock.requests] == ["key-first", "key-second", "key-second"]
    assert (
        metric_value(gateway, "switchyard_account_throttled_total", switchyard_account="first") >= 1
    )


async def test_the_sdk_waits_out_a_local_429_and_its_retry_succeeds(
    gateway: str, mock: MockProvider
) -> None:
    mock.set_behaviour("key-solo", Behaviour(status=429, headers={"retry-after": "1"}))
    async with anthropic.AsyncAnthropic(base_url=gateway, api_key="x", max_retries=0) as client:
        with pytest.raises(anthropic.RateLimitError):
            await client.messages.create(model="solo", max_tokens=8, messages=MESSAGES)
    mock.reset()  # the provider is fine again; the hold still says "1 s"
    # Default retries on: the SDK reads retry-after from switchyard's own 429 and tries again.
    async with anthropic.AsyncAnthropic(base_url=gateway, api_key="x") as client:
        reply = await client.messages.with_raw_response.create(
            model="solo", max_tokens=8, messages=MESSAGES
        )
    assert reply.http_response.status_code == 200
    assert len(mock.requests) == 1  # only the retry after the hold reached the provider
