"""Account affinity through a real Envoy: the example envoy.yaml, the processor and the mock
provider (a prompt cache per API key), called with the official Anthropic SDK.

The turns of one conversation land on one account, the one weighted rendezvous hashing of its
key ranks first (`core.affinity.pick`: the user id where the request has one), so its later
turns read the prompt cache its first turn wrote; the processor records those reads in
`gen_ai.client.token.usage` as `cache_read` tokens of that account.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import anthropic
import pytest
import pytest_asyncio

from envoy_rig import Rig, StartRig
from switchyard_mw.core.affinity import pick
from switchyard_mw.telemetry import names as tm
from switchyard_mw.telemetry import request_metrics as rm
from switchyard_mw.testing import Behaviour

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]
NAMES = ("aff-a", "aff-b", "aff-c")
KEYS = {f"KEY_{n[-1].upper()}": f"key-{n}" for n in NAMES}
MODEL = "affinity-envoy-model"
# The outage's 18 turns must all fall within the one cooling: about 0.15 s through grpcio on a
# quiet machine, but a turn stalled 0.4 s under CI's load once and a 0.5 s cooling ran out.
COOLDOWN_SECS = 2.0


def config_text(mock_url: str) -> str:
    return "".join(
        f'[llm_clients.{n}]\nbase_url = "{mock_url}"\napi_key_env = "KEY_{n[-1].upper()}"\n'
        f'models = ["{MODEL}"]\nenvoy_cluster = "mock"\n'
        f"failure_threshold = 1\ncooldown_secs = {COOLDOWN_SECS}\n\n"
        for n in NAMES
    )


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def rig(start_rig: StartRig) -> AsyncIterator[Rig]:
    async with start_rig(config_text, KEYS) as rig:
        yield rig


def cache_reads() -> dict[str, float]:
    """Input tokens read from the cache so far, by account, for this module's model."""
    rm.requests.fold()
    metric = rm.token_usage.metric(time.time_ns())
    out: dict[str, float] = {}
    for point in metric.data.data_points if metric is not None else ():
        attributes = dict(point.attributes or {})
        if attributes.get(tm.REQUEST_MODEL) == MODEL and attributes.get(tm.TOKEN_TYPE) == (
            "cache_read"
        ):
            account = str(attributes[tm.ACCOUNT])
            out[account] = out.get(account, 0.0) + point.sum  # type: ignore[attr-defined]
    return out


async def converse(
    rig: Rig, sdk: anthropic.AsyncAnthropic, opening: str, user: str | None, turns: int
) -> tuple[set[str], list[int]]:
    """One conversation of `turns` turns: (API keys its turns reached, cache reads per turn)."""
    messages: list[anthropic.types.MessageParam] = []
    keys, reads = set(), []
    for turn in range(turns):
        messages.append({"role": "user", "content": opening if turn == 0 else f"and {turn}?"})
        metadata: anthropic.types.MetadataParam = {"user_id": user} if user else {}
        answer = await sdk.messages.create(
            model=MODEL, max_tokens=16, messages=messages, metadata=metadata
        )
        keys.add(rig.mock.requests[-1].key)
        reads.append(answer.usage.cache_read_input_tokens or 0)
        messages.append({"role": "assistant", "content": answer.content[0].text})  # type: ignore[union-attr]
    return keys, reads


async def test_each_conversation_stays_on_its_rendezvous_account_and_reads_its_cache(
    rig: Rig,
) -> None:
    sdk = anthropic.AsyncAnthropic(base_url=rig.envoy_url, api_key="caller", max_retries=0)
    before = cache_reads()
    firsts: dict[str, int] = {}
    try:
        for conv in range(15):
            user = f"envoy-user-{conv}"
            opening = f"conversation {conv}: " + "a long shared system of rules. " * 40
            keys, reads = await converse(rig, sdk, opening, user, 3)
            (key,) = keys  # every turn on one account...
            expected = pick(user, [(n, 1.0) for n in NAMES])[0]
            assert key == f"key-{expected}"  # ...the one its user id ranks first
            assert reads[0] == 0 < reads[1] < reads[2]  # later turns read a growing prefix
            firsts[expected] = firsts.get(expected, 0) + 1
        # Without a user id the key is the first user turn: still one account per conversation.
        for conv in range(5):
            opening = f"anonymous {conv}: " + "another long prefix. " * 40
            keys, reads = await converse(rig, sdk, opening, None, 3)
            assert len(keys) == 1
            assert reads[1] > 0
    finally:
        await sdk.close()
    assert len(firsts) > 1  # fifteen conversations do not all rank one account first
    after = cache_reads()
    # The processor recorded the reads against the accounts that served them.
    gained = {a: after.get(a, 0.0) - before.get(a, 0.0) for a in NAMES}
    assert {a for a, v in gained.items() if v > 0} >= set(firsts)


async def test_when_an_account_cools_only_its_conversations_move_and_they_come_back(
    rig: Rig,
) -> None:
    """aff-b answers 500 (failure_threshold 1): the processor has Envoy retry its first
    request on that conversation's next account, and from then on its conversations go there
    directly; every other conversation stays. Healthy again after its cooling, aff-b is probed
    and its conversations return to it."""
    sdk = anthropic.AsyncAnthropic(base_url=rig.envoy_url, api_key="caller", max_retries=0)
    users = [f"cooling-user-{i}" for i in range(18)]
    histories: dict[str, list[anthropic.types.MessageParam]] = {u: [] for u in users}
    order = {u: pick(u, [(n, 1.0) for n in NAMES]) for u in users}

    async def turn(user: str) -> str:
        history = histories[user]
        history.append({"role": "user", "content": f"{user}, turn {len(history) // 2}"})
        answer = await sdk.messages.create(
            model=MODEL, max_tokens=8, messages=history, metadata={"user_id": user}
        )
        history.append({"role": "assistant", "content": answer.content[0].text})  # type: ignore[union-attr]
        return rig.mock.requests[-1].key.removeprefix("key-")

    try:
        assert [await turn(u) for u in users] == [order[u][0] for u in users]
        homed_on_b = [u for u in users if order[u][0] == "aff-b"]
        assert homed_on_b  # some conversations rank aff-b first
        served_by_b = sum(r.key == KEYS["KEY_B"] for r in rig.mock.requests)
        rig.mock.set_behaviour(KEYS["KEY_B"], Behaviour(status=500))
        during = [await turn(u) for u in users]
        expected = [order[u][1] if order[u][0] == "aff-b" else order[u][0] for u in users]
        assert during == expected
        tried_b = sum(r.key == KEYS["KEY_B"] for r in rig.mock.requests)
        assert tried_b == served_by_b + 1  # the one fault that cooled it
        rig.mock.clear_behaviour(KEYS["KEY_B"])
        await asyncio.sleep(COOLDOWN_SECS + 0.2)
        assert [await turn(u) for u in users] == [order[u][0] for u in users]
        # Back from its cooling, aff-b served each of its conversations again.
        assert sum(r.key == KEYS["KEY_B"] for r in rig.mock.requests) == tried_b + len(homed_on_b)
    finally:
        rig.mock.clear_behaviour(KEYS["KEY_B"])
        await sdk.close()
