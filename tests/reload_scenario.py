"""The canary-ramp-by-reload scenario both reload tests share (asgi/test_reload_live.py under
uvicorn workers, extproc/test_reload_envoy.py under Envoy): config, users, traffic, bounds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import anthropic
import openai

KEYS = {"KEY_MAIN": "key-main", "KEY_SLOW": "key-slow", "KEY_COOL": "key-cool"}
USERS = [f"user-{i}" for i in range(200)]
LONG_REPLY = "one two three four five six seven eight nine ten eleven twelve"


def config_text(mock_url: str, percent: float) -> str:
    return f"""
[llm_clients.main]
base_url = "{mock_url}"
api_key_env = "KEY_MAIN"
models = ["base", "var"]
envoy_cluster = "mock"

[llm_clients.slow]
base_url = "{mock_url}"
api_key_env = "KEY_SLOW"
auth = "x-api-key"
models = ["slow"]
envoy_cluster = "mock"

[llm_clients.cool]
base_url = "{mock_url}"
api_key_env = "KEY_COOL"
models = ["cool"]
failure_threshold = 1
cooldown_secs = 300
envoy_cluster = "mock"

[canaries.base]
variants = {{ var = {percent} }}
salt = "ramp"
"""


BROKEN = "\n[canaries.nobody]\nvariants = { var = -5 }\n"


def share_bounds(percent: float, n: int) -> tuple[float, float]:
    """Where the count of n conversations on a variant at `percent` falls (3.5 sd either side)."""
    p = percent / 100
    sd = (n * p * (1 - p)) ** 0.5
    return n * p - 3.5 * sd, n * p + 3.5 * sd


async def wait_for(check: Callable[[], object], what: str) -> None:
    """Until `check()` holds; at most 30 s."""
    end = time.monotonic() + 30
    while not await _ask(check):
        if time.monotonic() > end:
            raise TimeoutError(what)
        await asyncio.sleep(0.05)


async def _ask(check: Callable[[], object]) -> bool:
    result = check()
    if asyncio.iscoroutine(result):
        result = await result
    return bool(result)


async def placements(client: anthropic.AsyncAnthropic, users: list[str]) -> dict[str, str]:
    """The model each conversation (one per user) is placed on, as the upstream saw it."""
    limit = asyncio.Semaphore(8)

    async def one(user: str) -> tuple[str, str]:
        async with limit:
            message = await client.messages.create(
                model="base",
                max_tokens=16,
                messages=[{"role": "user", "content": "hi"}],
                metadata={"user_id": user},
            )
            return user, message.model

    return dict(await asyncio.gather(*(one(u) for u in users)))


async def steady(client: openai.AsyncOpenAI, stop: asyncio.Event, done: list[str]) -> None:
    """OpenAI SDK traffic until `stop`; any failure fails the test (the SDK does not retry)."""
    i = 0
    while not stop.is_set():
        answer = await client.chat.completions.create(
            model="base", messages=[{"role": "user", "content": f"steady {i}"}], user=f"s{i % 40}"
        )
        done.append(answer.model)
        i += 1
        await asyncio.sleep(0.02)  # steady, not flooding: the placements run beside it
