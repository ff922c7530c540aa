"""A two-turn tool loop through a real Envoy with the ext_proc server (the example envoy.yaml),
with the official SDKs, on every wire, streamed and not, on each ext_proc transport.

The call must reach the client intact (name, the provider's id, the same arguments, cut into
many pieces at awkward places), the tool result must reach the provider, and the processor's
request metrics must hold each turn's token usage as the SDK read it, cached tokens included.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from envoy_rig import Rig, StartRig
from switchyard_mw.telemetry import names as tm
from switchyard_mw.telemetry import request_metrics as rm
from tool_loops import ANSWER, RESULT, TOOL, TOOL_INPUT, WIRES, model_behaviour, run_loop

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]
MODELS = [f"tools-{wire}-{mode}" for wire in WIRES for mode in ("json", "stream")]


def config_text(mock_url: str) -> str:
    models = ", ".join(f'"{m}"' for m in MODELS)
    return f"""
[llm_clients.key-a]
base_url = "{mock_url}"
api_key_env = "KEY_A"
models = [{models}]
envoy_cluster = "mock"
"""


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def rig(start_rig: StartRig) -> AsyncIterator[Rig]:
    async with start_rig(config_text, {"KEY_A": "key-a"}) as rig:
        yield rig


def usage(model: str) -> dict[str, tuple[int, float]]:
    """The processor's token usage points for requests of `model`: (count, sum) by type."""
    rm.requests.fold()  # finished requests are held raw until a collection folds them
    metric = rm.token_usage.metric(time.time_ns())
    found = {}
    for point in metric.data.data_points if metric is not None else ():
        attributes = dict(point.attributes or {})
        if attributes.get(tm.REQUEST_MODEL) == model:
            found[str(attributes[tm.TOKEN_TYPE])] = (point.count, point.sum)
    return found


async def until_recorded(model: str, count: int) -> dict[str, tuple[int, float]]:
    """Under Envoy a request's metrics are recorded when the processor's stream for it ends,
    which may come a moment after the client read the last byte."""
    found = usage(model)
    for _ in range(100):
        if all(found.get(kind, (0,))[0] >= count for kind in ("input", "output")):
            break
        await asyncio.sleep(0.05)
        found = usage(model)
    return found


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("wire", WIRES)
async def test_a_tool_loop_through_envoy(rig: Rig, wire: str, stream: bool) -> None:
    rig.mock.reset()
    rig.mock.set_behaviour("*", model_behaviour(stream=stream))
    model = f"tools-{wire}-{'stream' if stream else 'json'}"
    before = usage(model)

    loop = await run_loop(wire, rig.envoy_url, model, stream=stream)

    asked, answered = rig.mock.requests
    assert (loop.call.name, loop.call.arguments) == (TOOL, TOOL_INPUT)
    assert (loop.call.id,) == asked.tool_call_ids  # as the provider sent it
    assert loop.call.id in answered.body.decode()  # and back with the tool's result
    assert RESULT in answered.body.decode()
    assert loop.said_first == (ANSWER if stream else "")
    assert loop.answer == ANSWER
    assert [turn.cache_read for turn in loop.turns] == [300, 300]

    was = {kind: before.get(kind, (0, 0.0)) for kind in ("input", "output")}
    after = await until_recorded(model, was["input"][0] + 2)
    gained = {kind: (after[kind][0] - was[kind][0], after[kind][1] - was[kind][1]) for kind in was}
    assert gained == {
        "input": (2, sum(turn.input for turn in loop.turns)),
        "output": (2, sum(turn.output for turn in loop.turns)),
    }
