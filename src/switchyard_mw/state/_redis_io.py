"""Opening and closing redis-py clients the way the store needs them, for each `[state] mode`,
and running the store's Lua scripts on them (by SHA, loaded again where a server lacks one).

Topology is redis-py's business: `RedisCluster` follows MOVED/ASK and refreshes its slot map
after a failover, `Sentinel.master_for` asks the sentinels for the master on each new
connection. The store only sees a call that worked or an error, and reconnects on an error.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import (
    Retry,
)  # the asyncio client's own (a sync one is converted, with a warning)
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisClusterException, RedisError

from ._lua import Script

ERRORS = (RedisError, RedisClusterException, OSError, TimeoutError)
"""What a store call may raise when Redis is down, slow or gone (a cluster's slot not served
during a failover raises `SlotNotCoveredError`, which is no `RedisError`)."""

Client = aioredis.Redis | RedisCluster
Mode = Literal["standalone", "cluster", "sentinel"]


@dataclass(frozen=True, slots=True)
class Target:
    """Where the store's Redis is: `[state]`'s mode, url, sentinels and service."""

    mode: Mode = "standalone"
    url: str | None = None
    sentinels: tuple[tuple[str, int], ...] = ()
    service: str = "mymaster"

    def describe(self) -> str:
        """For logs: where, without credentials."""
        if self.mode == "sentinel":
            where = ",".join(f"{host}:{port}" for host, port in self.sentinels)
            return f"sentinel {self.service} via {where}"
        assert self.url is not None  # config validation requires it outside sentinel mode
        parts = urlsplit(self.url)
        host = parts.hostname or parts.path
        where = f"{parts.scheme}://{host}" + (f":{parts.port}" if parts.port else "")
        return f"cluster {where}" if self.mode == "cluster" else where


def make_client(
    target: Target, *, socket_timeout: float | None, connect_timeout: float, decode: bool = True
) -> Client:
    # No client-side retries: a failure must surface at once, so the request goes on with
    # local state, and the store's reconnect loop (which resyncs) is the only retry. Cluster
    # redirections (MOVED, ASK) are not failures: RedisCluster follows them whatever `retry`.
    options: dict[str, Any] = {
        "decode_responses": decode,
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": connect_timeout,
        "retry": Retry(NoBackoff(), 0),  # the asyncio one: a sync Retry is converted, warning
    }
    if target.mode == "sentinel":
        sentinel = Sentinel(  # type: ignore[no-untyped-call,unused-ignore]  # typed from redis 8.2
            list(target.sentinels),
            sentinel_kwargs={"socket_timeout": connect_timeout},
            **{**options, **_credentials(target.url)},
        )
        master: aioredis.Redis = sentinel.master_for(target.service, **options)
        return master
    assert target.url is not None
    if target.mode == "cluster":
        return RedisCluster.from_url(target.url, **options)
    client: aioredis.Redis = aioredis.Redis.from_url(target.url, **options)
    return client


def _credentials(url: str | None) -> dict[str, object]:
    """What of a sentinel-mode url applies to the master: user, password, db, TLS."""
    if url is None:
        return {}
    parts = urlsplit(url)
    found: dict[str, object] = {"ssl": parts.scheme == "rediss"}
    if parts.username:
        found["username"] = unquote(parts.username)
    if parts.password:
        found["password"] = unquote(parts.password)
    if parts.path.strip("/").isdigit():
        found["db"] = int(parts.path.strip("/"))
    return found


async def subscriber(client: Client) -> PubSub:
    """A pub/sub on `client`; on a cluster, one connection to the node its channel hashes to."""
    if isinstance(client, RedisCluster):
        await client.initialize()  # the channel's node comes from the slot map
    return client.pubsub(ignore_subscribe_messages=True)


async def close_quietly(pubsub: PubSub | None, client: Client | None, *, within: float) -> None:
    """Close what is open; a dead or hung server must neither raise nor hold us up."""
    with contextlib.suppress(*ERRORS):
        async with asyncio.timeout(within):
            if pubsub is not None:
                await pubsub.aclose()  # type: ignore[no-untyped-call,unused-ignore]  # typed from redis 8.2
            if client is not None:
                await client.aclose()
                await _close_sentinels(client)


async def _close_sentinels(client: Client) -> None:
    pool = getattr(client, "connection_pool", None)
    if isinstance(pool, SentinelConnectionPool):
        for sentinel in pool.sentinel_manager.sentinels:
            await sentinel.aclose()


Call = tuple[tuple[str, ...], list[str | int]]
"""One run of a script: KEYS, ARGV."""


async def run_pipelined(
    commands: aioredis.Redis, script: Script, calls: Sequence[Call]
) -> list[Any]:
    """`script` once per call, in one round trip (a standalone server or a sentinel's master)."""
    async with commands.pipeline(transaction=False) as pipe:
        for keys_, args in calls:
            pipe.evalsha(script.sha, len(keys_), *keys_, *args)
        replies: list[Any] = await pipe.execute()
        return replies


async def run_by_key(commands: Client, script: Script, calls: Sequence[Call]) -> list[Any]:
    """Call by call: one alone, or a batch on a cluster, where redis-py pipelines no script.
    Each key's calls in their order (a reset must not overtake the fault before it), the keys
    (accounts) side by side."""
    replies: list[Any] = [None] * len(calls)
    by_key: dict[str, list[int]] = {}
    for i, (keys_, _) in enumerate(calls):
        by_key.setdefault(keys_[0], []).append(i)

    async def run(indexes: list[int]) -> None:
        for i in indexes:
            replies[i] = await _one(commands, script, calls[i])

    await asyncio.gather(*(run(indexes) for indexes in by_key.values()))
    return replies


async def _one(commands: Client, script: Script, call: Call) -> Any:
    keys_, args = call
    try:
        return await commands.evalsha(script.sha, len(keys_), *keys_, *args)
    except NoScriptError:
        # A server without the script: restarted, a replica just promoted, a slot's new
        # owner, or one it was never run on. It did not run there; EVAL runs it and leaves
        # it cached on that server, in one round trip.
        return await commands.eval(script.text, len(keys_), *keys_, *args)
