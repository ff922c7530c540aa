"""A reload with `[state] backend = "redis"`: the store follows the new pool both ways."""

from __future__ import annotations

import pytest
from test_state_redis import MakeReplica, cooled, fault, redis_server, replica, spec

from redis_server import until
from switchyard_mw.core.pool import AccountPool, Outcome
from switchyard_mw.engine.claims import acquire_shared

pytestmark = pytest.mark.integration  # starts real servers

__all__ = ["redis_server", "replica"]  # the fixtures this module uses


async def test_after_a_reload_the_store_shares_the_new_pool_s_state(replica: MakeReplica) -> None:
    accounts = [spec(n, failure_threshold=1, cooldown_secs=30.0) for n in ("x", "y", "z")]
    old, store = await replica(*accounts)
    other, _ = await replica(*accounts)
    in_flight = await acquire_shared(old, "m", allowed={"z"})  # a request started before the reload
    assert in_flight is not None

    new = AccountPool(accounts, clock=old.clock)  # the reloaded config's pool
    new.carry_over(old)
    store.bind(new)

    await fault(other, "x")  # another replica cools x: the new pool hears of it
    await until(lambda: cooled(new, "x"))
    await fault(new, "y")  # the new pool cools y: the other replica hears of it
    await until(lambda: cooled(other, "y"))
    old.record(in_flight, Outcome.FAULT)  # the old request's fault: in the new pool, and shared
    assert cooled(new, "z")
    await until(lambda: cooled(other, "z"))
