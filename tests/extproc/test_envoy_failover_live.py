"""Failover across providers inside one request, through a real Envoy (examples/envoy/envoy.yaml)
and the processor, with the official SDKs, on both processor transports (issue 46).

Two provider clusters, `mock` and `mock-other` (both the mock here: Envoy's own counters say
which cluster each attempt went to), and the example's aggregate clusters over them. With
`server.envoy_failover` naming the aggregates, an outage of the first provider is answered by
the other provider's account in the same request, and a fallback chain whose model only the
other provider serves is tried; without it, a retry stays on its cluster as before.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest
import pytest_asyncio

from envoy_rig import Rig, StartRig
from sdk_calls import OPENAI_WIRES, STREAMS, anthropic_call, openai_call
from switchyard_mw.testing import Behaviour, MockProvider

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration]
KEYS = {f"KEY_{n}": f"key-{n.lower()}" for n in "ABCDE"}
OUT = Behaviour(status=503)
FAILOVER = """
[server.envoy_failover]
"mock-then-other" = ["mock", "mock-other"]
"other-then-mock" = ["mock-other", "mock"]
"""


def config_text(mock_url: str, *, failover: bool = True) -> str:
    def account(name: str, key: str, cluster: str, models: list[str], priority: int) -> str:
        return (
            f'[llm_clients.{name}]\nbase_url = "{mock_url}"\napi_key_env = "KEY_{key}"\n'
            f'auth = "x-api-key"\nmodels = {models!r}\npriority = {priority}\n'
            f'failure_threshold = 100\nenvoy_cluster = "{cluster}"\n'.replace("'", '"')
        )

    return (
        account("one", "A", "mock", ["gpt-x", "claude-opus-5", "gpt-own"], 0)
        + account("one-more", "E", "mock", ["gpt-own"], 1)
        + account("other", "B", "mock-other", ["gpt-x", "claude-opus-5"], 1)
        + account("solo", "C", "mock", ["gpt-solo", "claude-solo"], 0)
        + account("small", "D", "mock-other", ["gpt-x-mini", "claude-sonnet-5"], 0)
        + '\n[fallbacks]\n"gpt-solo" = ["gpt-x-mini"]\n"claude-solo" = ["claude-sonnet-5"]\n'
        + (FAILOVER if failover else "")
    )


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def rig(start_rig: StartRig) -> AsyncIterator[Rig]:
    async with start_rig(config_text, KEYS, admin=True) as rig:
        yield rig


@pytest_asyncio.fixture(loop_scope="module")
async def gateway(rig: Rig) -> str:
    rig.configure()
    return rig.envoy_url


def seen(mock: MockProvider) -> list[tuple[str, str | None]]:
    return [(r.key, r.model) for r in mock.requests]


def moved(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {c: after.get(c, 0) - before.get(c, 0) for c in ("mock", "mock-other")}


# --- an outage of one provider: the other provider's cluster serves, in the same request ------


@STREAMS
@OPENAI_WIRES
async def test_openai_an_outage_of_one_provider_the_other_serves(
    rig: Rig, gateway: str, stream: bool, responses: bool
) -> None:
    rig.mock.set_behaviour("key-a", OUT)
    before = rig.sent_to()
    text, headers = await openai_call(gateway, "gpt-x", stream, responses)
    assert text
    assert headers["x-switchyard-account"] == "other"
    assert headers["x-switchyard-attempts"] == "2"
    assert seen(rig.mock) == [("key-a", "gpt-x"), ("key-b", "gpt-x")]
    assert moved(before, rig.sent_to()) == {"mock": 1, "mock-other": 1}


@STREAMS
async def test_anthropic_an_outage_of_one_provider_the_other_serves(
    rig: Rig, gateway: str, stream: bool
) -> None:
    rig.mock.set_behaviour("key-a", OUT)
    before = rig.sent_to()
    text, headers = await anthropic_call(gateway, "claude-opus-5", stream)
    assert text
    assert headers["x-switchyard-account"] == "other"
    assert seen(rig.mock) == [("key-a", "claude-opus-5"), ("key-b", "claude-opus-5")]
    assert moved(before, rig.sent_to()) == {"mock": 1, "mock-other": 1}


async def test_with_the_first_provider_held_the_request_starts_on_the_other(
    rig: Rig, gateway: str
) -> None:
    """The account of the first provider held (a 429's retry time), the request is routed to
    the aggregate the other provider heads, and served there at once."""
    rig.processor.servicer.policies.pool.hold("one", "gpt-x", 30)
    before = rig.sent_to()
    text, headers = await openai_call(gateway, "gpt-x", False, False)
    assert text
    assert headers["x-switchyard-account"] == "other"
    assert seen(rig.mock) == [("key-b", "gpt-x")]
    assert moved(before, rig.sent_to()) == {"mock": 0, "mock-other": 1}


# --- a fallback chain whose model only the other provider serves --------------------------------


@STREAMS
@OPENAI_WIRES
async def test_openai_a_chain_s_model_on_the_other_provider_is_tried(
    rig: Rig, gateway: str, stream: bool, responses: bool
) -> None:
    rig.mock.set_behaviour("key-c", OUT)
    before = rig.sent_to()
    text, headers = await openai_call(gateway, "gpt-solo", stream, responses)
    assert text
    assert headers["x-switchyard-model"] == "gpt-x-mini"
    assert headers["x-switchyard-route"] == "fallback:unavailable"
    assert headers["x-switchyard-account"] == "small"
    assert seen(rig.mock) == [("key-c", "gpt-solo"), ("key-d", "gpt-x-mini")]
    assert all(int(r.headers["content-length"]) == len(r.body) for r in rig.mock.requests)
    assert moved(before, rig.sent_to()) == {"mock": 1, "mock-other": 1}


@STREAMS
async def test_anthropic_a_chain_s_model_on_the_other_provider_is_tried(
    rig: Rig, gateway: str, stream: bool
) -> None:
    rig.mock.set_behaviour("key-c", OUT)
    text, headers = await anthropic_call(gateway, "claude-solo", stream)
    assert text
    assert headers["x-switchyard-model"] == "claude-sonnet-5"
    assert headers["x-switchyard-account"] == "small"
    assert seen(rig.mock) == [("key-c", "claude-solo"), ("key-d", "claude-sonnet-5")]


# --- a model only the first provider serves: its retries stay there ---------------------------


@STREAMS
async def test_a_model_one_provider_serves_fails_over_between_its_keys(
    rig: Rig, gateway: str, stream: bool
) -> None:
    """Routed to the aggregate, the retry would go to the other provider, where nothing
    serves gpt-own: routed to the provider's own cluster, the retry takes its other key."""
    rig.mock.set_behaviour("key-a", OUT)
    before = rig.sent_to()
    text, headers = await openai_call(gateway, "gpt-own", stream, False)
    assert text
    assert headers["x-switchyard-account"] == "one-more"
    assert seen(rig.mock) == [("key-a", "gpt-own"), ("key-e", "gpt-own")]
    assert moved(before, rig.sent_to()) == {"mock": 2, "mock-other": 0}


# --- without server.envoy_failover, a retry stays on its cluster ------------------------------


async def test_without_envoy_failover_the_retry_stays_on_the_cluster(
    rig: Rig, gateway: str
) -> None:
    rig.configure(failover=False)
    rig.mock.set_behaviour("key-a", OUT)
    before = rig.sent_to()
    with pytest.raises(openai.APIStatusError) as refused:
        await openai_call(gateway, "gpt-x", False, False)
    assert refused.value.status_code == 503
    assert seen(rig.mock) == [("key-a", "gpt-x")]
    assert moved(before, rig.sent_to()) == {"mock": 1, "mock-other": 0}
