"""Why an account cools, shared on a real Redis: a replica that learns a cooling from another
(as it happens, or when it starts late) answers what the replica that saw the refusal answers."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import msgspec
import pytest

from redis_server import RedisServer, running_redis, until
from switchyard_mw.accounts import build_accounts, pool_from_accounts
from switchyard_mw.config import parse_config
from switchyard_mw.context import RequestContext
from switchyard_mw.core.pool import BreakerState, Cause, Outcome
from switchyard_mw.engine.claims import acquire_shared
from switchyard_mw.engine.policies import Engine
from switchyard_mw.state._lua import parse
from switchyard_mw.state.redis_store import RedisStore
from switchyard_mw.wire import Wire, read_request

pytestmark = pytest.mark.integration  # starts real servers

CONFIG = """
[llm_clients.x]
base_url = "https://api.anthropic.com"
api_key_env = "KEY"
models = ["m"]
failure_threshold = 1
cooldown_secs = 30

[llm_clients.y]
base_url = "https://api.anthropic.com"
api_key_env = "KEY"
models = ["m"]
failure_threshold = 1
cooldown_secs = 30
"""
BODY = msgspec.json.encode({"model": "m", "max_tokens": 5, "messages": []})
MakeReplica = Callable[[], Awaitable[Engine]]


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    yield from running_redis(tmp_path)


@pytest.fixture
async def replica(redis_server: RedisServer) -> AsyncIterator[MakeReplica]:
    stores: list[RedisStore] = []

    async def make() -> Engine:
        config = parse_config(CONFIG)
        accounts = build_accounts(config, {"KEY": "k"})
        pool = pool_from_accounts(accounts)
        store = RedisStore(redis_server.url, key_prefix="t", timeout_secs=0.5)
        store.bind(pool)
        stores.append(store)
        await store.start()
        await until(lambda: store.healthy)
        return Engine(server=config.server, accounts=accounts, pool=pool)

    yield make
    for store in stores:
        await store.aclose()


def answer(engine: Engine) -> tuple[int, str, dict[bytes, bytes]]:
    ctx = RequestContext(view=read_request(Wire.ANTHROPIC, BODY), body=BODY)
    error, headers = engine.nothing_serves(ctx)
    return error.status, error.message, dict(headers)


async def fail(engine: Engine, account: str, status: str) -> None:
    lease = await acquire_shared(engine.pool, "m", allowed={account})
    assert lease is not None
    engine.settle(lease, Outcome.FAULT, status, "m")


def cause(engine: Engine, account: str) -> Cause | None:
    status = engine.pool.status_of(account)
    return status.cause if status.state is BreakerState.COOLED else None


async def test_a_refused_key_is_shared_as_such(replica: MakeReplica) -> None:
    a, b = await replica(), await replica()
    await fail(a, "x", "401")
    await fail(a, "y", "403")
    await until(lambda: cause(b, "x") is Cause.CREDENTIALS and cause(b, "y") is Cause.CREDENTIALS)
    learnt = answer(b)
    assert learnt[0] == 503
    assert "refused the credentials of every account" in learnt[1]
    assert learnt[2] == {b"x-should-retry": b"false"}
    assert learnt == answer(a)


async def test_an_outage_learnt_from_another_replica_keeps_its_retry_after(
    replica: MakeReplica,
) -> None:
    a, b = await replica(), await replica()
    await fail(a, "x", "401")
    await fail(a, "y", "503")
    await until(lambda: cause(b, "x") is Cause.CREDENTIALS and cause(b, "y") is Cause.OUTAGE)
    status, message, headers = answer(b)
    assert (status, message) == (
        503,
        "no healthy upstream account for model 'm'; the credentials of some were refused",
    )
    assert headers in ({b"retry-after": b"30"}, {b"retry-after": b"29"})
    assert answer(b) == answer(a)


async def test_a_replica_that_starts_late_learns_why(replica: MakeReplica) -> None:
    a = await replica()
    await fail(a, "x", "401")
    await fail(a, "y", "402")
    late = await replica()
    assert cause(late, "x") is Cause.CREDENTIALS
    assert cause(late, "y") is Cause.CREDENTIALS
    assert answer(late) == answer(a)


@pytest.mark.parametrize(
    ("message", "kind", "why"),
    [
        # As a replica without the cause sends it, and as an outage's cooling still reads.
        ("cool|3|30000|29000|-|o1|x", "cool", Cause.OUTAGE),
        ("cool/credentials|3|30000|29000|-|o1|x", "cool", Cause.CREDENTIALS),
        ("held/credentials|1|30000|12|500|o1|x|y", "held", Cause.CREDENTIALS),
        ("closed|0|30000|-|0|o1|x", "closed", Cause.OUTAGE),
    ],
)
def test_messages_name_the_cause_only_for_refused_credentials(
    message: str, kind: str, why: Cause
) -> None:
    found, origin, shared = parse(message)
    assert (found, origin, shared.cause) == (kind, "o1", why)
    assert shared.closed is (kind == "closed")
