"""The example gateway under a real uvicorn server, called with the official SDKs.

The mock provider runs in this process (so the test sets its behaviour directly); the gateway
runs as `uvicorn examples.starlette_app:app` in a subprocess, as a user would run it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from servers import example_gateway, metric_value, serve_in_thread
from switchyard_mw.testing import Behaviour, MockProvider

pytestmark = pytest.mark.integration

ENV = {"KEY_A": "key-a-secret", "KEY_B": "key-b-secret", "JUDGE_KEY": "judge-key"}


def config(mock_url: str, *, timeout_secs: float = 60) -> str:
    return f"""
[llm_clients.a]
base_url = "{mock_url}"
api_key_env = "KEY_A"
auth = "x-api-key"
models = ["claude-opus-5", "claude-opus-5-5", "gpt-5"]
timeout_secs = {timeout_secs}
failure_threshold = 100

[llm_clients.judge]
base_url = "{mock_url}"
api_key_env = "JUDGE_KEY"
models = ["gpt-judge"]

[canaries."claude-opus-5"]
variants = {{ "claude-opus-5-5" = 50.0 }}

[routes.auto]
classifier = "llm"
judge = "judge"
judge_model = "gpt-judge"
judge_deadline_ms = 300
choices = {{ simple = "gpt-5", complex = "claude-opus-5" }}
fallback = "claude-opus-5-5"
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
    _, mock_url = mock
    with example_gateway(config(mock_url), tmp_path_factory.mktemp("gw"), ENV) as url:
        yield url


@pytest.fixture(autouse=True)
def clean_mock(mock: tuple[MockProvider, str]) -> None:
    mock[0].reset()


async def test_anthropic_sdk_non_streaming_and_streaming(
    gateway: str, mock: tuple[MockProvider, str]
) -> None:
    provider, _ = mock
    client = anthropic.AsyncAnthropic(base_url=gateway, api_key="caller-key", max_retries=0)
    raw = await client.messages.with_raw_response.create(
        model="gpt-5", max_tokens=50, messages=[{"role": "user", "content": "hi"}]
    )
    message = await raw.parse()
    assert message.content[0].type == "text"
    assert message.content[0].text
    assert message.model == "gpt-5"
    assert raw.headers["x-switchyard-account"] == "a"
    assert raw.headers["x-switchyard-attempts"] == "1"
    assert raw.headers["x-switchyard-deadline-ms"] == "60000"

    text = ""
    async with client.messages.stream(
        model="gpt-5", max_tokens=50, messages=[{"role": "user", "content": "stream please"}]
    ) as stream:
        async for chunk in stream.text_stream:
            text += chunk
    assert text
    # The caller's credential never reaches the upstream: the account's key replaced it.
    seen = provider.requests
    assert [r.key for r in seen] == ["key-a-secret", "key-a-secret"]
    assert all("caller-key" not in str(r.headers) for r in seen)
    await client.close()


async def test_openai_sdk_chat_and_responses(gateway: str, mock: tuple[MockProvider, str]) -> None:
    client = openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key="caller-key", max_retries=0)
    completion = await client.chat.completions.create(
        model="gpt-5", messages=[{"role": "user", "content": "hi"}]
    )
    assert completion.choices[0].message.content
    chunks = []
    stream = await client.chat.completions.create(
        model="gpt-5", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            chunks.append(chunk.choices[0].delta.content)
    assert "".join(chunks)
    response = await client.responses.create(model="gpt-5", input="hi")
    assert response.output_text
    events = [
        e.type async for e in await client.responses.create(model="gpt-5", input="hi", stream=True)
    ]
    assert events[-1] == "response.completed"
    await client.close()


async def test_canary_conversation_sticks_to_one_variant_through_the_gateway(
    gateway: str, mock: tuple[MockProvider, str]
) -> None:
    provider, _ = mock
    client = anthropic.AsyncAnthropic(base_url=gateway, api_key="k", max_retries=0)
    landed: dict[str, set[str]] = {}
    for i in range(12):
        history: list[anthropic.types.MessageParam] = [
            {"role": "user", "content": f"conversation {i}"}
        ]
        for _turn in range(3):
            reply = await client.messages.create(
                model="claude-opus-5", max_tokens=20, messages=history
            )
            landed.setdefault(str(i), set()).add(reply.model)
            history += [
                {"role": "assistant", "content": reply.content[0].text},
                {"role": "user", "content": "go on"},
            ]
    assert all(len(models) == 1 for models in landed.values())
    assert set().union(*landed.values()) == {"claude-opus-5", "claude-opus-5-5"}
    # The mock saw the resolved model in the body, not the requested one.
    assert {r.model for r in provider.requests} == {"claude-opus-5", "claude-opus-5-5"}
    await client.close()


async def test_bad_input_gets_the_wire_error_through_the_sdk(gateway: str) -> None:
    async with httpx.AsyncClient(base_url=gateway) as http:
        r = await http.post(
            "/v1/messages", content=b'{"model": ', headers={"content-type": "application/json"}
        )
    assert r.status_code == 400
    assert r.json()["type"] == "error"
    client = anthropic.AsyncAnthropic(base_url=gateway, api_key="k", max_retries=0)
    with pytest.raises(anthropic.BadRequestError):
        await client.messages.create(model="gpt-5", max_tokens=-1, messages=[])
    await client.close()


def test_metrics_and_accounts_endpoints(gateway: str) -> None:
    httpx.post(
        f"{gateway}/v1/chat/completions",
        json={
            "model": "claude-opus-5",
            "user": "u1",
            "messages": [{"role": "user", "content": "x"}],
        },
    )
    assert (
        metric_value(
            gateway, "switchyard_variant_assignments_total", gen_ai_request_model="claude-opus-5"
        )
        >= 1
    )
    accounts = httpx.get(f"{gateway}/switchyard/accounts")
    assert accounts.status_code == 200
    assert "key-a-secret" not in accounts.text
    assert '"a"' in accounts.text


@pytest.fixture
def slow_gateway(mock: tuple[MockProvider, str], tmp_path: Path) -> Iterator[str]:
    _, mock_url = mock
    with example_gateway(config(mock_url, timeout_secs=1), tmp_path, ENV) as url:
        yield url


async def test_live_deadline_grows_with_the_output_cap(
    slow_gateway: str, mock: tuple[MockProvider, str]
) -> None:
    """timeout_secs 1, a 2 s upstream: 100 tokens (2.81 s) succeed, 10 tokens (1 s) get 504."""
    provider, _ = mock
    provider.set_behaviour("*", Behaviour(headers_delay_secs=2.0))
    client = anthropic.AsyncAnthropic(base_url=slow_gateway, api_key="k", max_retries=0)
    ok = await client.messages.with_raw_response.create(
        model="gpt-5", max_tokens=100, messages=[{"role": "user", "content": "long"}]
    )
    assert ok.status_code == 200
    assert ok.headers["x-switchyard-deadline-ms"] == "2812"

    started = time.monotonic()
    with pytest.raises(anthropic.APIStatusError) as info:
        await client.messages.create(
            model="gpt-5", max_tokens=10, messages=[{"role": "user", "content": "short"}]
        )
    elapsed = time.monotonic() - started
    assert info.value.status_code == 504
    assert info.value.body["error"]["type"] == "deadline_exceeded"  # type: ignore[index]
    assert 0.9 < elapsed < 1.9
    await client.close()


async def test_stalled_judge_fails_open_within_its_deadline_and_metrics_show_it(
    gateway: str, mock: tuple[MockProvider, str]
) -> None:
    provider, _ = mock
    before = metric_value(gateway, "switchyard_classifier_fail_open_total", reason="deadline")
    provider.set_behaviour("judge-key", Behaviour(headers_delay_secs=30))
    client = openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key="k", max_retries=0)
    started = time.monotonic()
    raw = await client.chat.completions.with_raw_response.create(
        model="auto", messages=[{"role": "user", "content": "which model?"}]
    )
    elapsed = time.monotonic() - started
    completion = raw.parse()
    assert completion.model == "claude-opus-5-5"  # the route's fallback
    assert raw.headers["x-switchyard-route"] == "fail_open:deadline"
    assert elapsed < 0.3 + 1.5
    after = metric_value(gateway, "switchyard_classifier_fail_open_total", reason="deadline")
    assert after == before + 1
    await client.close()


async def test_judge_answer_routes_to_its_choice(
    gateway: str, mock: tuple[MockProvider, str]
) -> None:
    mock[0].set_behaviour("judge-key", Behaviour(reply="simple"))
    async with httpx.AsyncClient(base_url=gateway) as http:
        r = await http.post(
            "/v1/chat/completions",
            json={"model": "auto", "messages": [{"role": "user", "content": "2+2?"}]},
        )
    assert r.status_code == 200
    assert r.json()["model"] == "gpt-5"
    assert r.headers["x-switchyard-route"] == "judge:simple"


def test_a_200_shows_on_metrics_with_its_model_variant_and_account(gateway: str) -> None:
    labels = {
        "gen_ai_request_model": "claude-opus-5",
        "switchyard_account": "a",
    }
    name = "gen_ai_client_operation_duration_seconds_count"
    before = metric_value(gateway, name, **labels)
    answer = httpx.post(
        f"{gateway}/v1/chat/completions",
        json={
            "model": "claude-opus-5",
            "user": "u7",
            "messages": [{"role": "user", "content": "x"}],
        },
    )
    assert answer.status_code == 200
    routed = answer.headers["x-switchyard-model"]
    assert metric_value(gateway, name, **labels) == before + 1
    assert (
        metric_value(
            gateway, name, **labels, gen_ai_response_model=routed, switchyard_variant=routed
        )
        >= 1
    )
    states = [
        line
        for line in httpx.get(f"{gateway}/metrics").text.splitlines()
        if line.startswith("switchyard_account_state{") and 'switchyard_account="a"' in line
    ]
    assert len(states) == 1
    assert states[0].endswith(" 0.0")  # closed
