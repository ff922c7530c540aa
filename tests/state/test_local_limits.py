"""The in-process limit store: the ledger's reserve, settle and release behind the async
interface every front awaits (the Redis store has the same)."""

from __future__ import annotations

from switchyard_mw.core.limits import Granted, LimitKey, Measure, Refused
from switchyard_mw.state.limit_stores import LimitStore, LocalLimits

TOKENS = LimitKey(scope="t", measure=Measure.TOKENS, per="minute", amount=100)


class Clock:
    now = 1_000_020.0

    def __call__(self) -> float:
        return self.now


async def test_reserve_settle_release_through_the_store_interface() -> None:
    store: LimitStore = LocalLimits(clock=Clock())
    granted = await store.reserve({TOKENS: 80})
    assert isinstance(granted, Granted)
    assert isinstance(await store.reserve({TOKENS: 30}), Refused)
    await store.settle(granted.reservation, {Measure.TOKENS: 10})
    assert store.used(TOKENS) == 10
    second = await store.reserve({TOKENS: 90})
    assert isinstance(second, Granted)
    await store.release(second.reservation)
    assert store.used(TOKENS) == 10
    assert store.name == "memory"
