"""Account affinity through the ASGI stack with the official SDK and the mock provider: one
conversation's turns land on one account and read its prompt cache."""

from __future__ import annotations

import anthropic
import httpx
import httpx2
from starlette.applications import Starlette
from starlette.routing import Route

from switchyard_mw.asgi.stack import switchyard_stack
from switchyard_mw.config import parse_config
from switchyard_mw.gateway import WIRE_ROUTES, Forwarder
from switchyard_mw.testing.mock_provider import MockProvider

NAMES = ("a", "b", "c")
CONFIG = "".join(
    f'[llm_clients.{n}]\nbase_url = "http://mock.test/"\napi_key_env = "K_{n}"\n'
    f'auth = "x-api-key"\nmodels = ["m"]\n'
    for n in NAMES
)
ENVIRON = {f"K_{n}": f"key-{n}" for n in NAMES}


async def test_a_conversations_turns_land_on_its_rendezvous_account_and_read_the_cache() -> None:
    mock = MockProvider()
    upstream = httpx.AsyncClient(transport=httpx.ASGITransport(app=mock))
    app = Starlette(routes=[Route(p, Forwarder(upstream), methods=["POST"]) for p in WIRE_ROUTES])
    stack = switchyard_stack(app, config=parse_config(CONFIG), environ=ENVIRON)
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=stack))
    sdk = anthropic.AsyncAnthropic(api_key="x", base_url="http://gw.test", http_client=http)
    try:
        for conv in range(12):
            first = f"conversation {conv}: " + "a long shared prefix. " * 50
            messages: list[anthropic.types.MessageParam] = []
            cached = []
            for turn in range(3):
                messages.append(
                    {"role": "user", "content": first if turn == 0 else f"go on {turn}"}
                )
                answer = await sdk.messages.create(model="m", max_tokens=16, messages=messages)
                cached.append(answer.usage.cache_read_input_tokens or 0)
                messages.append({"role": "assistant", "content": answer.content[0].text})  # type: ignore[union-attr]
            keys = {r.key for r in mock.requests[-3:]}
            assert len(keys) == 1, keys  # every turn on one account
            assert cached[0] == 0
            assert cached[1] > 0
            assert cached[2] > cached[1]
        # Twelve conversations do not all sit on one account.
        assert len({r.key for r in mock.requests}) > 1
    finally:
        await http.aclose()
        await upstream.aclose()
