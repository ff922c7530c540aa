"""Opening and closing redis-py clients the way the store needs them."""

from __future__ import annotations

import asyncio
import contextlib

import redis.asyncio as aioredis
from redis.asyncio.client import PubSub
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

ERRORS = (RedisError, OSError, TimeoutError)
"""What a store call may raise when Redis is down, slow or gone."""


def make_client(
    url: str, *, socket_timeout: float | None, connect_timeout: float, decode: bool = True
) -> aioredis.Redis:
    # No client-side retries: a failure must surface at once, so the request goes on with
    # local state, and the store's reconnect loop (which resyncs) is the only retry.
    client: aioredis.Redis = aioredis.Redis.from_url(
        url,
        decode_responses=decode,
        socket_timeout=socket_timeout,
        socket_connect_timeout=connect_timeout,
        retry=Retry(NoBackoff(), 0),
    )
    return client


async def close_quietly(
    pubsub: PubSub | None, client: aioredis.Redis | None, *, within: float
) -> None:
    """Close what is open; a dead or hung server must neither raise nor hold us up."""
    with contextlib.suppress(*ERRORS):
        async with asyncio.timeout(within):
            if pubsub is not None:
                await pubsub.aclose()  # type: ignore[no-untyped-call]
            if client is not None:
                await client.aclose()
