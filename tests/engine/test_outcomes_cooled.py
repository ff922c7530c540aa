"""`switchyard.account.cooled` counts the faults that start a cooling, read from the state the
pool reports: a cooling whose period ran out reads half-open, so a fault on it is counted only
when it cools the account again (its probe's), not a straggler's that changes nothing."""

from __future__ import annotations

from conftest import Metrics
from switchyard_mw.core.pool import AccountPool, AccountSpec, BreakerState, Lease, Outcome
from switchyard_mw.engine.outcomes import settle
from switchyard_mw.telemetry import names as tm

FAULT = Outcome.FAULT


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def take(pool: AccountPool, model: str) -> Lease:
    lease = pool.acquire(model)
    assert lease is not None
    return lease


def test_a_probe_fault_after_the_period_counts_a_straggler_does_not(
    otel_metrics: Metrics,
) -> None:
    clock = FakeClock()
    for name, models in (("oc-solo", {"oc-m"}), ("oc-dual", {"oc-d", "oc-e"})):
        pool = AccountPool(
            [AccountSpec(name=name, models=frozenset(models), failure_threshold=1)], clock=clock
        )
        model = min(models)
        unit = None if len(models) == 1 else model

        def cooled(name: str = name) -> float:
            return otel_metrics.value(tm.ACCOUNT_COOLED, **{tm.ACCOUNT: name})

        before = cooled()
        straggler = take(pool, model)
        settle(pool, take(pool, model), FAULT, "503")
        assert cooled() == before + 1
        clock.now += 30.0  # the period ran out: half-open, no probe yet
        assert pool.status_of(name, model=unit).state is BreakerState.HALF_OPEN
        settle(pool, straggler, FAULT, "503")  # sent before the cooling: changes nothing
        assert cooled() == before + 1
        assert pool.status_of(name, model=unit).probe_due
        probe = take(pool, model)
        assert probe.probe
        settle(pool, probe, FAULT, "503")  # the probe fails: it cools again
        assert pool.status_of(name, model=unit).state is BreakerState.COOLED
        assert cooled() == before + 2
