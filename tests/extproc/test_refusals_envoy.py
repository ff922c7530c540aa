"""Every key refused, under a real Envoy: the processor answers what the ASGI stack answers
(`tests/asgi/test_refusals_live.py`), and an official SDK with default retries fails at once."""

from __future__ import annotations

import time

import anthropic
import httpx
import pytest
from test_envoy_live import message, otlp, rig

from envoy_rig import Rig
from switchyard_mw.core.pool import BreakerState, Cause
from switchyard_mw.testing import Behaviour

__all__ = ["otlp", "rig"]  # fixtures, used by name
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration]
REFUSED = "the upstream refused the credentials of every account (401, 402 or 403)"


async def cool_both(rig: Rig, client: httpx.AsyncClient, a: int, b: int) -> None:
    """key-a answers `a`, key-b `b`: one request faults both (the second on Envoy's retry)."""
    policies = rig.configure(failure_threshold=1)
    rig.mock.reset()
    rig.mock.set_behaviour("key-a", Behaviour(status=a))
    rig.mock.set_behaviour("key-b", Behaviour(status=b))
    first = await client.post("/v1/messages", json=message("claude-haiku-5"))
    assert first.headers["x-switchyard-attempts"] == "2"
    for key in ("key-a", "key-b"):
        # (A 5xx cools an account serving several models for this model only.)
        assert not policies.pool.closed_for(key, "claude-haiku-5")
    rig.mock.clear_requests()


@pytest.mark.parametrize("status", [401, 402, 403])
async def test_every_key_refused_is_answered_as_the_stack_answers_it(rig: Rig, status: int) -> None:
    async with httpx.AsyncClient(base_url=rig.envoy_url, timeout=10) as client:
        await cool_both(rig, client, status, status)
        response = await client.post("/v1/messages", json=message("claude-haiku-5"))
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "no_healthy_account"
    assert REFUSED in response.json()["error"]["message"]
    assert "retry-after" not in response.headers
    assert response.headers["x-should-retry"] == "false"
    assert rig.mock.requests == []
    # The SDK with its default retries: one request, and the error at once.
    sent: list[str] = []

    async def note(request: object) -> None:
        sent.append(str(getattr(request, "url", "")))

    started = time.perf_counter()
    async with anthropic.AsyncAnthropic(
        base_url=rig.envoy_url,
        api_key="x",
        http_client=anthropic.DefaultAsyncHttpxClient(event_hooks={"request": [note]}),
    ) as sdk:
        with pytest.raises(anthropic.InternalServerError) as error:
            await sdk.messages.create(**message("claude-haiku-5"))
    took = time.perf_counter() - started
    print(f"Envoy, {status} on every key: {took:.3f} s per SDK call, default retries")
    assert REFUSED in str(error.value)
    assert len(sent) == 1
    assert took < 5.0


async def test_an_outage_beside_a_refused_key_keeps_its_retry_after(rig: Rig) -> None:
    async with httpx.AsyncClient(base_url=rig.envoy_url, timeout=10) as client:
        await cool_both(rig, client, 401, 503)
        response = await client.post("/v1/messages", json=message("claude-haiku-5"))
    policies = rig.processor.servicer.policies
    assert policies.pool.status_of("key-a").cause is Cause.CREDENTIALS
    pair = policies.pool.status_of("key-b", model="claude-haiku-5")
    assert (pair.state, pair.cause) == (BreakerState.COOLED, Cause.OUTAGE)
    assert response.status_code == 503
    assert response.json()["error"]["message"] == (
        "no healthy upstream account for model 'claude-haiku-5'; "
        "the credentials of some were refused"
    )
    assert 25 <= int(response.headers["retry-after"]) <= 30
    assert "x-should-retry" not in response.headers
