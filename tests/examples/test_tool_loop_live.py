"""A two-turn tool loop through the example gateway (`uvicorn examples.starlette_app:app`), with
the official SDKs, on every wire, streamed and not.

The model (the mock provider) asks for a tool with arguments that are hard to cut (quotes, a
backslash, characters of 2-4 UTF-8 bytes) sent in many pieces; the SDK must read the call
intact (name, id as the provider sent it, the same arguments), the client's tool result must
reach the provider with that id, and the gateway's `gen_ai_client_token_usage` must gain each
turn's usage as the SDK read it, cached input tokens included.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest

from servers import example_gateway, serve_in_thread
from switchyard_mw.testing import MockProvider
from tool_loops import ANSWER, RESULT, TOOL, TOOL_INPUT, WIRES, model_behaviour, run_loop

pytestmark = pytest.mark.integration

ENV = {"KEY_A": "key-a-secret"}
MODELS = [f"tools-{wire}-{mode}" for wire in WIRES for mode in ("json", "stream")]


def config(mock_url: str) -> str:
    return f"""
[llm_clients.a]
base_url = "{mock_url}"
api_key_env = "KEY_A"
models = {MODELS!r}
""".replace("'", '"')


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


def usage(gateway: str, model: str) -> dict[str, float]:
    """The gateway's `gen_ai_client_token_usage` count and sum for `model`, by token type."""
    text = httpx.get(f"{gateway}/metrics").text
    kinds = ("input", "output", "cache_read", "cache_creation")
    found = dict.fromkeys((f"{k}_{p}" for k in kinds for p in ("count", "sum")), 0.0)
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        name, _, labels = series.partition("{")
        part = name.removeprefix("gen_ai_client_token_usage_")
        if part in ("count", "sum") and f'gen_ai_request_model="{model}"' in labels:
            kind = re.search(r'gen_ai_token_type="(\w+)"', labels)
            assert kind is not None, line
            found[f"{kind.group(1)}_{part}"] += float(value)
    return found


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("wire", WIRES)
async def test_a_tool_loop_through_the_gateway(
    gateway: str, mock: tuple[MockProvider, str], wire: str, stream: bool
) -> None:
    provider, _ = mock
    provider.reset()
    provider.set_behaviour("*", model_behaviour(stream=stream))
    model = f"tools-{wire}-{'stream' if stream else 'json'}"
    before = usage(gateway, model)

    loop = await run_loop(wire, gateway, model, stream=stream)

    asked, answered = provider.requests
    assert (loop.call.name, loop.call.arguments) == (TOOL, TOOL_INPUT)
    assert (loop.call.id,) == asked.tool_call_ids  # as the provider sent it
    assert loop.call.id in answered.body.decode()  # and back with the tool's result
    assert RESULT in answered.body.decode()
    assert answered.tool_call_ids == ()
    assert loop.said_first == (ANSWER if stream else "")
    assert loop.answer == ANSWER
    assert [turn.cache_read for turn in loop.turns] == [300, 300]

    after = usage(gateway, model)
    gained = {key: after[key] - before[key] for key in after}
    assert gained == {
        "input_count": 2,
        "input_sum": sum(turn.input for turn in loop.turns),
        "output_count": 2,
        "output_sum": sum(turn.output for turn in loop.turns),
        # The cached parts of the input, as their own token types; only Anthropic says what
        # the cache wrote.
        "cache_read_count": 2,
        "cache_read_sum": sum(turn.cache_read for turn in loop.turns),
        "cache_creation_count": 2 if wire == "anthropic" else 0,
        "cache_creation_sum": (
            2 * model_behaviour(stream=stream).cache_write_tokens if wire == "anthropic" else 0
        ),
    }
