"""End to end over real sockets: official OpenAI SDK -> gateway (JudgeMiddleware) -> mock provider.

One mock provider under uvicorn plays both the judge and the upstream (told apart by API key);
the gateway is JudgeMiddleware around a minimal forwarding app, under uvicorn too.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from servers import serving
from switchyard_mw.accounts import Account
from switchyard_mw.asgi._types import Receive, Scope, Send
from switchyard_mw.asgi.judge_middleware import JudgeMiddleware
from switchyard_mw.clients.outbound import make_http_client
from switchyard_mw.config import LLMClient, Route
from switchyard_mw.telemetry import names as tm
from switchyard_mw.testing import Behaviour, MockProvider

pytestmark = pytest.mark.integration  # starts real servers

JUDGE_KEY = "judge-key"
UPSTREAM_KEY = "upstream-key"


class Forwarder:
    """A minimal gateway app: posts the body it receives upstream and relays the answer."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.http = make_http_client()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await self.http.aclose()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = (await receive())["body"]
        upstream = await self.http.post(
            self.upstream + scope["path"],
            content=body,
            headers={"authorization": f"Bearer {UPSTREAM_KEY}", "content-type": "application/json"},
            timeout=10,
        )
        headers = [(b"content-type", upstream.headers["content-type"].encode())]
        await send(
            {"type": "http.response.start", "status": upstream.status_code, "headers": headers}
        )
        await send({"type": "http.response.body", "body": upstream.content})


@pytest.fixture
async def stack() -> AsyncIterator[tuple[MockProvider, str]]:
    """(the mock provider, the gateway's base URL)."""
    mock = MockProvider()
    async with serving(mock, lifespan="on") as provider_url:
        route = Route(
            classifier="llm",
            judge="judge",
            judge_model="gpt-judge",
            choices={"simple": "mock-small", "complex": "mock-big"},
            fallback="mock-fallback",
            judge_deadline_ms=300,
        )
        spec = LLMClient(base_url=provider_url, models=["*"])
        judge = Account(name="judge", spec=spec, api_key=JUDGE_KEY)
        gateway = JudgeMiddleware(
            Forwarder(provider_url), routes={"auto": route}, accounts={"judge": judge}
        )
        async with serving(gateway, lifespan="on") as gateway_url:
            yield mock, gateway_url


async def ask(gateway_url: str) -> tuple[str, httpx.Headers]:
    async with openai.AsyncOpenAI(
        api_key="caller-key", base_url=gateway_url + "/v1", max_retries=0, timeout=10
    ) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="auto", messages=[{"role": "user", "content": "What is 2 + 2?"}]
        )
        completion = raw.parse()
        return completion.model, httpx.Headers(dict(raw.headers))


async def test_a_stalled_judge_fails_open_to_the_fallback_fast(
    stack: tuple[MockProvider, str], otel_metrics: Any
) -> None:
    mock, gateway_url = stack
    mock.set_behaviour(JUDGE_KEY, Behaviour(headers_delay_secs=30))
    before = otel_metrics.value(tm.CLASSIFIER_FAIL_OPEN, route="auto", reason="deadline")
    started = time.monotonic()
    model, headers = await ask(gateway_url)
    elapsed = time.monotonic() - started
    assert model == "mock-fallback"  # the upstream mock echoes the model it was asked for
    assert headers["x-switchyard-route"] == "fail_open:deadline"
    assert 0.3 <= elapsed < 0.3 + 1.5
    after = otel_metrics.value(tm.CLASSIFIER_FAIL_OPEN, route="auto", reason="deadline")
    assert after == before + 1
    judged, forwarded = mock.requests
    assert (judged.key, judged.model) == (JUDGE_KEY, "gpt-judge")
    assert (forwarded.key, forwarded.model) == (UPSTREAM_KEY, "mock-fallback")


async def test_a_prompt_judge_routes_by_its_verdict(stack: tuple[MockProvider, str]) -> None:
    mock, gateway_url = stack
    mock.set_behaviour(JUDGE_KEY, Behaviour(reply="simple"))
    model, headers = await ask(gateway_url)
    assert model == "mock-small"
    assert headers["x-switchyard-route"] == "judge:simple"
