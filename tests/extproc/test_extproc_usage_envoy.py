"""Token usage through a real Envoy: the example envoy.yaml, the processor and the mock provider.

The official SDKs call through Envoy; each answer's usage as the SDK read it must show up in
the processor's `gen_ai.client.token.usage`, with the request's labels, for a JSON answer and
for each wire's stream, and the answer must reach the client as the provider sent it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import anthropic
import httpx
import openai
import pytest
import pytest_asyncio

from envoy_rig import Rig, StartRig
from switchyard_mw.telemetry import names as tm
from switchyard_mw.telemetry import request_metrics as rm
from switchyard_mw.testing import Behaviour, MockProvider
from usage_streams import all_input

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]
KEYS = {"KEY_A": "key-a"}
LABELS = {
    tm.REQUEST_MODEL: "usage-base",
    tm.RESPONSE_MODEL: "usage-var",
    tm.VARIANT: "usage-var",
    tm.ACCOUNT: "key-a",
}
TURN = [{"role": "user", "content": "How many tokens is this?"}]
STALL_SECS = 6.0
REPLY = "Quite a few tokens, one after another, in several chunks. " * 20


def config_text(mock_url: str) -> str:
    return f"""
[llm_clients.key-a]
base_url = "{mock_url}"
api_key_env = "KEY_A"
models = ["usage-base", "usage-var"]
envoy_cluster = "mock"

[canaries."usage-base"]
variants = {{ "usage-var" = 100.0 }}
"""


@pytest.fixture(scope="module")
def mock_provider() -> MockProvider:
    return MockProvider(reply=REPLY)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def rig(start_rig: StartRig) -> AsyncIterator[Rig]:
    async with start_rig(config_text, KEYS) as rig:
        yield rig


@pytest_asyncio.fixture(loop_scope="module")
async def claude(rig: Rig) -> AsyncIterator[anthropic.AsyncAnthropic]:
    client = anthropic.AsyncAnthropic(base_url=rig.envoy_url, api_key="caller", max_retries=0)
    yield client
    await client.close()


@pytest_asyncio.fixture(loop_scope="module")
async def gpt(rig: Rig) -> AsyncIterator[openai.AsyncOpenAI]:
    client = openai.AsyncOpenAI(base_url=f"{rig.envoy_url}/v1", api_key="caller", max_retries=0)
    yield client
    await client.close()


class Tally:
    """What the processor's request metrics gained for the request's labels."""

    def __init__(self) -> None:
        self.before = self.read()

    @staticmethod
    def read() -> dict[str, tuple[int, float]]:
        out: dict[str, tuple[int, float]] = {}
        rm.requests.fold()  # finished requests are held raw until a collection folds them
        now = time.time_ns()
        for tally, kind in ((rm.token_usage, None), (rm.duration, "duration")):
            metric = tally.metric(now)
            for point in metric.data.data_points if metric is not None else ():
                attributes = dict(point.attributes or {})
                name = kind or str(attributes.pop(tm.TOKEN_TYPE, ""))
                if attributes == LABELS:
                    out[name] = (point.count, point.sum)
        return out

    def gained(self) -> dict[str, tuple[int, float]]:
        after = self.read()
        gained = {}
        for name, (count, total) in after.items():
            was_count, was_total = self.before.get(name, (0, 0.0))
            if count != was_count:
                gained[name] = (count - was_count, total - was_total)
        return gained

    def tokens(self) -> tuple[float | None, float | None]:
        gained = self.gained()
        assert gained.get("duration", (0,))[0] == 1, gained  # one request, no error type
        return tuple(gained[k][1] if k in gained else None for k in ("input", "output"))  # type: ignore[return-value]

    def cache(self) -> tuple[float | None, float | None]:
        """The prompt cache reads and writes recorded for the request (None: none recorded)."""
        gained = self.gained()
        kinds = ("cache_read", "cache_creation")
        return tuple(gained[k][1] if k in gained else None for k in kinds)  # type: ignore[return-value]


@pytest.fixture
def tally() -> Tally:
    return Tally()


async def test_an_anthropic_json_answer(claude: anthropic.AsyncAnthropic, tally: Tally) -> None:
    message = await claude.messages.create(model="usage-base", max_tokens=500, messages=TURN)  # type: ignore[arg-type]
    assert message.content[0].text == REPLY  # type: ignore[union-attr]
    assert tally.tokens() == (all_input(message.usage), message.usage.output_tokens)
    usage = message.usage
    assert tally.cache() == (usage.cache_read_input_tokens, usage.cache_creation_input_tokens)


async def test_an_anthropic_stream(claude: anthropic.AsyncAnthropic, tally: Tally) -> None:
    async with claude.messages.stream(
        model="usage-base",
        max_tokens=500,
        messages=TURN,  # type: ignore[arg-type]
    ) as stream:
        final = await stream.get_final_message()
    assert final.content[0].text == REPLY  # type: ignore[union-attr]
    assert tally.tokens() == (all_input(final.usage), final.usage.output_tokens)
    usage = final.usage
    assert tally.cache() == (usage.cache_read_input_tokens, usage.cache_creation_input_tokens)


async def test_an_openai_chat_json_answer(gpt: openai.AsyncOpenAI, tally: Tally) -> None:
    completion = await gpt.chat.completions.create(model="usage-base", messages=TURN)  # type: ignore[arg-type]
    assert completion.usage is not None
    assert completion.choices[0].message.content == REPLY
    usage = completion.usage
    assert tally.tokens() == (usage.prompt_tokens, usage.completion_tokens)
    assert usage.prompt_tokens_details is not None
    # OpenAI's wires say what the cache read, not what it wrote.
    assert tally.cache() == (usage.prompt_tokens_details.cached_tokens, None)


async def test_an_openai_chat_stream_with_usage(gpt: openai.AsyncOpenAI, tally: Tally) -> None:
    stream = await gpt.chat.completions.create(
        model="usage-base",
        messages=TURN,  # type: ignore[arg-type]
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    async for chunk in stream:
        text += "".join(c.delta.content or "" for c in chunk.choices)
        usage = chunk.usage or usage
    assert text == REPLY
    assert usage is not None
    assert tally.tokens() == (usage.prompt_tokens, usage.completion_tokens)
    assert usage.prompt_tokens_details is not None
    assert tally.cache() == (usage.prompt_tokens_details.cached_tokens, None)


async def test_an_openai_responses_stream(gpt: openai.AsyncOpenAI, tally: Tally) -> None:
    stream = await gpt.responses.create(model="usage-base", input="How many?", stream=True)
    usage = None
    async for event in stream:
        if event.type == "response.completed":
            usage = event.response.usage
    assert usage is not None
    assert tally.tokens() == (usage.input_tokens, usage.output_tokens)
    assert tally.cache() == (usage.input_tokens_details.cached_tokens, None)


async def test_a_json_answer_keeps_its_length_and_a_stream_its_bytes(rig: Rig) -> None:
    body = {"model": "usage-base", "max_tokens": 50, "messages": TURN}
    async with httpx.AsyncClient(base_url=rig.envoy_url, timeout=10) as http:
        answer = await http.post("/v1/messages", json=body)
        assert answer.status_code == 200
        assert answer.headers["content-length"] == str(len(answer.content))
        events = await http.post("/v1/messages", json={**body, "stream": True})
        assert events.status_code == 200
    # The stream arrives whole and in order, as the provider wrote it.
    names = [line for line in events.text.splitlines() if line.startswith("event: ")]
    assert names[0] == "event: message_start"
    assert names[-2:] == ["event: message_delta", "event: message_stop"]
    assert events.text.endswith("\n\n")


async def test_a_stream_read_for_its_usage_is_not_held_back(rig: Rig, tally: Tally) -> None:
    """The provider stalls after its first delta for longer than the client waits for a read:
    the events before the stall must reach the client before the stall ends (a processor or an
    Envoy that held the body would deliver nothing until then). The client then leaves: the
    request's telemetry ends with what the stream said so far (message_start's usage)."""
    rig.mock.set_behaviour(
        "key-a", Behaviour(stall_after_chunks=1, body_stall_secs=STALL_SECS, chunks=3)
    )
    body = {"model": "usage-base", "max_tokens": 50, "messages": TURN, "stream": True}
    timeout = httpx.Timeout(10, read=STALL_SECS * 2 / 3)
    seen: list[str] = []
    try:
        async with (
            httpx.AsyncClient(base_url=rig.envoy_url, timeout=timeout) as http,
            http.stream("POST", "/v1/messages", json=body) as events,
        ):
            assert events.status_code == 200
            async for line in events.aiter_lines():
                seen.append(line)
                if line == "event: content_block_delta":
                    break  # the first delta came while the provider still stalls
        for _ in range(100):  # Envoy ends the processor's stream once the client has left
            if "duration" in tally.gained():
                break
            await asyncio.sleep(0.05)
    finally:
        rig.mock.reset()
    assert seen[0] == "event: message_start"
    input_tokens, output_tokens = tally.tokens()
    assert input_tokens is not None
    assert input_tokens > 0
    assert output_tokens == 1  # message_start's placeholder: the rest never came
    assert len(rig.processor.servicer.flights) == 0
