"""The canary guard through the example gateway (uvicorn), the mock provider and the SDK."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from servers import example_gateway, metric_value, serve_in_thread
from switchyard_mw.testing import Behaviour, MockProvider

pytestmark = pytest.mark.integration

CONFIG = """
[llm_clients.base-acct]
base_url = "{mock}"
api_key_env = "KEY_BASE"
auth = "x-api-key"
models = ["g-base"]

[llm_clients.var-acct]
base_url = "{mock}"
api_key_env = "KEY_VAR"
auth = "x-api-key"
models = ["g-var"]
failure_threshold = 100000    # never cooled: every variant request still tries it

[canaries."g-base"]
variants = {{ "g-var" = 50.0 }}
guard = {{ max_fault_rate = 0.2, min_requests = 20, window_secs = 60 }}
"""
KEYS = {"KEY_BASE": "key-base", "KEY_VAR": "key-var"}
TURN: Any = [{"role": "user", "content": "hello"}]
THINKING: Any = [
    {"role": "user", "content": "hello"},
    {
        "role": "assistant",
        "content": [{"type": "thinking", "thinking": "hm", "signature": "sig-from-g-var"}],
    },
    {"role": "user", "content": "and then?"},
]


@pytest.fixture(scope="module")
def mock() -> Iterator[tuple[MockProvider, str]]:
    provider = MockProvider()
    with serve_in_thread(provider) as url:
        yield provider, url


async def ask(client: anthropic.AsyncAnthropic, user: str, messages: Any = TURN) -> Any:
    return await client.messages.with_raw_response.create(
        model="g-base", max_tokens=8, messages=messages, metadata={"user_id": user}
    )


async def test_a_failing_variant_is_rolled_back_and_a_thinking_conversation_stays(
    mock: tuple[MockProvider, str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    provider, url = mock
    config = CONFIG.format(mock=url)
    with example_gateway(config, tmp_path_factory.mktemp("guard"), KEYS) as gateway:
        async with anthropic.AsyncAnthropic(base_url=gateway, api_key="x", max_retries=0) as c:
            placed = {u: (await ask(c, u)).headers["x-switchyard-model"] for u in _users(40)}
            on_variant = [u for u, model in placed.items() if model == "g-var"]
            assert len(on_variant) >= 10  # about half of 40
            provider.set_behaviour("key-var", Behaviour(status=500))
            # Each request of a variant user: the variant's 500 is a fault, the base serves it.
            for user in on_variant * 3:
                answer = await ask(c, user)
                assert answer.http_response.status_code == 200
            async with httpx.AsyncClient() as http:
                status = (await http.get(f"{gateway}/switchyard/canaries")).json()["canaries"]
            (canary,) = status
            assert canary["tripped"] == ["g-var"]
            window = canary["window"]["g-var"]
            assert window["attempts"] >= 20  # min_requests, successes before the 500s included
            assert window["faults"] / window["attempts"] > 0.2
            assert (
                metric_value(
                    gateway,
                    "switchyard_canary_guard_trips_total",
                    gen_ai_request_model="g-base",
                    switchyard_variant="g-var",
                )
                == 1
            )
            provider.set_behaviour("key-var", Behaviour())  # healthy again: no matter
            provider.clear_requests()
            for user in on_variant:  # existing conversations now go to the base directly
                answer = await ask(c, user)
                assert answer.headers["x-switchyard-model"] == "g-base"
                assert answer.headers["x-switchyard-attempts"] == "1"
            assert {r.key for r in provider.requests} == {"key-base"}
            for user in _users(200)[40:]:  # and so do new ones
                assert (await ask(c, user)).headers["x-switchyard-model"] == "g-base"
            # Signed thinking binds a conversation to its model: it keeps its variant.
            pinned = await ask(c, on_variant[0], THINKING)
            assert pinned.headers["x-switchyard-model"] == "g-var"


def _users(n: int) -> list[str]:
    return [f"guard-user-{i}" for i in range(n)]
