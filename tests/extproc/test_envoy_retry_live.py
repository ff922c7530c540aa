"""Retries under a real Envoy running examples/envoy/envoy.yaml, with the official SDKs: a retry
in place (the only account of a model answers 429 `retry-after: 2`; Envoy's rate-limited
back-off waits the 2 s and the processor sends the retry to the same account), and an attempt
whose answer never started (a refused connection, a reset before the headers), which Envoy
retries and the processor charges to its account and moves to another.

The mock runs under uvicorn on a thread, the processor as a grpc.aio server on this module's
event loop, Envoy once for the module; each test installs its own config.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import openai
import pytest
import pytest_asyncio

from envoy_rig import Rig, StartRig
from servers import raw_server, read_http_request, refusing_port
from switchyard_mw.core.pool import BreakerState
from switchyard_mw.extproc import Policies
from switchyard_mw.testing import DEFAULT_REPLY, Behaviour

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration]
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


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def rig(start_rig: StartRig) -> AsyncIterator[Rig]:
    async with start_rig(config_text, KEYS) as rig:
        yield rig


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
    assert raw.headers["x-switchyard-attempts"] == "2"
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


# --- an answer that never started: Envoy retries it on another account --------------------------

CANNED = (
    b'{"id":"msg_1","type":"message","role":"assistant","model":"m1","content":'
    b'[{"type":"text","text":"from b"}],"stop_reason":"end_turn","stop_sequence":null,'
    b'"usage":{"input_tokens":1,"output_tokens":2}}'
)


def two_keys(upstream_url: str) -> str:
    """Two keys of one cluster serving m1: a first, b on failover."""
    account = f'base_url = "{upstream_url}"\nauth = "x-api-key"\nmodels = ["m1"]\n'
    return f"""
[llm_clients.a]
api_key_env = "KEY_A"
priority = 0
{account}envoy_cluster = "mock"

[llm_clients.b]
api_key_env = "KEY_B"
priority = 1
{account}envoy_cluster = "mock"
"""


async def resets_key_a(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A provider whose connection drops before any answer to key a; key b is served."""
    while True:
        head, _ = await read_http_request(reader)
        if b"\r\nx-api-key: key-a\r\n" in head.lower():
            served["a"] += 1
            return  # the connection closes with nothing sent
        served["b"] += 1
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(CANNED)}\r\n\r\n".encode()
            + CANNED
        )
        await writer.drain()


served = {"a": 0, "b": 0}


@contextlib.asynccontextmanager
async def envoy_before(
    start_rig: StartRig, upstream_url: str
) -> AsyncIterator[tuple[str, Policies]]:
    """The example's Envoy and a processor with `two_keys`, its mock cluster at
    `upstream_url`."""
    async with start_rig(two_keys, KEYS, upstream=upstream_url) as rig:
        yield rig.envoy_url, rig.policies


async def test_a_reset_before_the_headers_is_retried_on_another_key(start_rig: StartRig) -> None:
    served.update(a=0, b=0)
    async with (
        raw_server(resets_key_a) as (url, _),
        envoy_before(start_rig, url) as (envoy, policies),
    ):
        client = anthropic.AsyncAnthropic(base_url=envoy, api_key="caller", max_retries=0)
        async with client:
            raw = await client.messages.with_raw_response.create(
                model="m1", max_tokens=9, messages=QUESTION
            )
            answer = await raw.parse()
    assert answer.content[0].text == "from b"  # type: ignore[union-attr]
    assert served == {"a": 1, "b": 1}
    assert raw.headers["x-switchyard-account"] == "b"
    assert raw.headers["x-switchyard-attempts"] == "2"
    # The dropped attempt is its key's fault, as a connect error through the ASGI front.
    assert policies.pool.status_of("a").consecutive_faults == 1
    assert policies.pool.status_of("b").consecutive_faults == 0


async def test_a_refused_connection_is_charged_once(start_rig: StartRig) -> None:
    """Envoy retries a refused connection too (`reset` covers connect failures), but on
    loopback the retry fails within the millisecond, before the processor's answer to its
    request headers: the key is charged once, by the router-level stream, as before."""
    with refusing_port() as nobody:  # every connection is refused
        await _charged_once(nobody, start_rig)


async def _charged_once(nobody: int, start_rig: StartRig) -> None:
    async with envoy_before(start_rig, f"http://127.0.0.1:{nobody}") as (envoy, policies):
        client = anthropic.AsyncAnthropic(base_url=envoy, api_key="caller", max_retries=0)
        async with client:
            with pytest.raises(anthropic.APIStatusError) as info:
                await client.messages.create(model="m1", max_tokens=9, messages=QUESTION)
    assert info.value.status_code == 502
    assert info.value.body["error"]["type"] == "upstream_unreachable"  # type: ignore[index]
    assert policies.pool.status_of("a").consecutive_faults == 1
    # b is charged only if a retry reached the processor in time (then it was b's attempt).
    assert policies.pool.status_of("b").consecutive_faults <= 1


async def test_a_providers_own_retry_header_asks_no_retry(rig: Rig) -> None:
    """Only the processor asks Envoy for a retry: a provider that sends x-switchyard-retry
    itself is answered once, and charged nothing."""
    policies = rig.configure()
    rig.mock.set_behaviour("key-a", Behaviour(status=400, headers={"x-switchyard-retry": "1"}))
    async with gpt(rig) as client:
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model="m1", messages=QUESTION)
    assert len(rig.mock.requests) == 1
    assert policies.pool.status_of("a").consecutive_faults == 0
