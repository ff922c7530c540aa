"""Faults per (account, model): an account serving several models cools for one model on its
model faults, for every model on a refused key; each pair has its own half-open probe."""

from __future__ import annotations

import pytest
from test_pool import FakeClock

from switchyard_mw.core import pool as pool_module
from switchyard_mw.core.pool import (
    AccountPool,
    AccountSpec,
    BreakerState,
    Cause,
    Lease,
    Outcome,
    Recovery,
)
from switchyard_mw.core.shared import Change, Shared

CLOSED, COOLED, HALF_OPEN = BreakerState.CLOSED, BreakerState.COOLED, BreakerState.HALF_OPEN


def make(threshold: int = 1, *models: str) -> tuple[AccountPool, FakeClock]:
    clock = FakeClock(0.0)
    dual = AccountSpec(
        name="dual",
        models=frozenset(models or ("m1", "m2")),
        failure_threshold=threshold,
        cooldown_secs=10.0,
    )
    spare = AccountSpec(name="spare", models=frozenset({"m1", "m2"}), priority=1)
    return AccountPool([dual, spare], clock=clock), clock


def on_dual(pool: AccountPool, model: str) -> Lease:
    lease = pool.acquire(model, allowed={"dual"})
    assert lease is not None
    return lease


def fail(pool: AccountPool, model: str, cause: Cause = Cause.OUTAGE) -> None:
    pool.record(on_dual(pool, model), Outcome.FAULT, cause)


def state(pool: AccountPool, model: str | None = None) -> BreakerState:
    return pool.status_of("dual", model=model).state


def test_a_model_fault_cools_that_pair_only() -> None:
    pool, _ = make()
    fail(pool, "m1")
    assert (state(pool), state(pool, "m1"), state(pool, "m2")) == (CLOSED, COOLED, CLOSED)
    assert pool.acquire("m1").account == "spare"  # type: ignore[union-attr]
    assert pool.acquire("m2").account == "dual"  # type: ignore[union-attr]
    assert not pool.closed_for("dual", "m1")
    assert pool.closed_for("dual", "m2")
    assert pool.pairs() == [("dual", "m1")]
    assert list(pool.pair_status("dual")) == ["m1"]


@pytest.mark.parametrize("status", [Cause.CREDENTIALS])
def test_a_refused_key_cools_the_account_for_every_model(status: Cause) -> None:
    pool, _ = make()
    fail(pool, "m1", status)
    assert state(pool) is COOLED
    assert pool.acquire("m1", allowed={"dual"}) is None
    assert pool.acquire("m2", allowed={"dual"}) is None
    assert pool.pairs() == []


def test_one_model_account_keeps_one_breaker_as_before() -> None:
    pool, _ = make(1, "m1")
    lease = on_dual(pool, "m1")
    assert lease.model is None  # the same lease as before the pairs
    pool.record(lease, Outcome.FAULT)
    assert state(pool) is COOLED
    assert pool.pairs() == []


def test_the_pairs_probe_is_its_own() -> None:
    pool, clock = make()
    fail(pool, "m1")
    clock.advance(10.0)
    probe = on_dual(pool, "m1")
    assert (probe.probe, probe.pair_probe, probe.unit) == (True, True, "m1")
    assert state(pool, "m1") is HALF_OPEN
    assert pool.status_of("dual", model="m1").probe_in_flight
    assert pool.acquire("m1", allowed={"dual"}) is None  # one probe per pair
    assert not on_dual(pool, "m2").probe  # the other model is served as usual
    assert pool.retry_after_secs("m1", allowed={"dual"}) == pool_module.PROBE_RETRY_AFTER_SECS
    pool.record(probe, Outcome.SUCCESS)
    assert state(pool, "m1") is CLOSED
    assert pool.pairs() == []  # healthy again: no breaker of its own


def test_a_failed_pair_probe_recools_the_pair() -> None:
    pool, clock = make()
    fail(pool, "m1")
    clock.advance(10.0)
    pool.record(on_dual(pool, "m1"), Outcome.FAULT)
    assert state(pool, "m1") is COOLED
    assert pool.status_of("dual", model="m1").cooled_until == clock.now + 10.0
    assert state(pool) is CLOSED


def test_a_pair_probe_meeting_a_refused_key_cools_the_account_and_frees_the_slot() -> None:
    pool, clock = make()
    fail(pool, "m1")
    clock.advance(10.0)
    pool.record(on_dual(pool, "m1"), Outcome.FAULT, Cause.CREDENTIALS)
    assert state(pool) is COOLED
    assert not pool.status_of("dual", model="m1").probe_in_flight
    assert pool.acquire("m2", allowed={"dual"}) is None


def test_released_and_throttled_pair_probes_free_their_slot() -> None:
    pool, clock = make()
    fail(pool, "m1")
    clock.advance(10.0)
    pool.release(on_dual(pool, "m1"))
    pool.record(on_dual(pool, "m1"), Outcome.THROTTLE)
    probe = on_dual(pool, "m1")
    assert probe.pair_probe


def test_counts_are_per_model_and_a_success_clears_the_key_count() -> None:
    pool, _ = make(2)
    fail(pool, "m1")
    pool.record(on_dual(pool, "m2"), Outcome.SUCCESS)  # m2's success: m1 still counts 1
    fail(pool, "m1")
    assert state(pool, "m1") is COOLED
    fail(pool, "m2", Cause.CREDENTIALS)
    pool.record(on_dual(pool, "m2"), Outcome.SUCCESS)  # the key works: its count is 0 again
    assert pool.status_of("dual").consecutive_faults == 0
    fail(pool, "m2", Cause.CREDENTIALS)
    assert state(pool) is CLOSED


def test_recovery_and_retry_after_read_the_pair() -> None:
    pool, clock = make()
    fail(pool, "m1")
    clock.advance(4.0)
    assert pool.retry_after_secs("m1", allowed={"dual"}) == 6.0
    assert pool.recovery("m1", allowed={"dual"}) == Recovery(6.0, None)
    assert pool.retry_after_secs("m2", allowed={"dual"}) == 0.0


def test_a_wildcard_account_keeps_at_most_max_pairs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pool_module, "MAX_PAIRS", 2)
    pool, _ = make(1, "*")
    fail(pool, "x1")
    fail(pool, "x2")
    assert state(pool) is CLOSED
    fail(pool, "x3")  # no room for a third pair: counted against the account, as before
    assert state(pool) is COOLED


def test_a_reload_keeps_the_pairs_of_accounts_that_still_serve_several_models() -> None:
    old, clock = make()
    fail(old, "m1")
    new = AccountPool(
        [
            AccountSpec(name="dual", models=frozenset({"m1", "m2"}), cooldown_secs=10.0),
            AccountSpec(name="spare", models=frozenset({"m1", "m2"}), priority=1),
        ],
        clock=clock,
    )
    new.carry_over(old)
    assert new.status_of("dual", model="m1").state is COOLED
    one = AccountPool([AccountSpec(name="dual", models=frozenset({"m1"}))], clock=clock)
    one.carry_over(old)
    assert one.pairs() == []  # serving one model now: one breaker, closed


def test_a_fault_recorded_on_the_old_pool_after_a_reload_reaches_the_new_one() -> None:
    old, clock = make()
    lease = on_dual(old, "m1")
    new = AccountPool(old.specs, clock=clock)
    new.carry_over(old)
    old.record(lease, Outcome.FAULT)
    assert new.status_of("dual", model="m1").state is COOLED


class Store:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str | None, Change]] = []

    def changed(
        self, account: str, change: Change, local: Shared, *, model: str | None = None
    ) -> None:
        self.seen.append((account, model, change))

    def held(self, account: str, model: str, until_unix: float) -> None:
        pass

    async def claim_probe(self, account: str, model: str | None = None) -> Shared | None:
        return None


def test_the_store_hears_of_each_pairs_changes_with_its_model() -> None:
    pool, clock = make()
    store = Store()
    pool.attach(store)
    fail(pool, "m1")
    fail(pool, "m2", Cause.CREDENTIALS)
    clock.advance(10.0)
    pool.record(on_dual(pool, "m1"), Outcome.SUCCESS)  # the account's probe: key fixed
    assert store.seen == [
        ("dual", "m1", Change.FAULT),
        ("dual", None, Change.FAULT),
        ("dual", None, Change.PROBE_SUCCESS),
    ]
    # m1's pair stays out: its period ran out too, so its own probe is due (half-open).
    assert state(pool, "m1") is HALF_OPEN
    assert pool.status_of("dual", model="m1").probe_due
    # The shared state of another replica lands on the pair named.
    pool.merge("dual", Shared(1, 10.0, 30.0), model="m2")
    assert state(pool, "m2") is COOLED
    pool.merge("dual", Shared(0, 10.0, None, closed=True), model="m2")
    assert ("dual", "m2") not in pool.pairs()
