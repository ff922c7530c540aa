"""The state an account (or an (account, model) pair) reports once its cooling period ran out.

Design, fourth round: when a cooling period has run out and no probe has gone yet, the breaker
is half-open with a probe due, whether or not a request has arrived since; it is cooled only
while its period runs. An injected clock moves time; nothing here sends a request to see it.
"""

from __future__ import annotations

import pytest

from switchyard_mw.core.pool import (
    AccountPool,
    AccountSpec,
    AccountStatus,
    BreakerState,
    Cause,
    Lease,
    Outcome,
)
from switchyard_mw.core.shared import Shared

CLOSED, COOLED, HALF_OPEN = BreakerState.CLOSED, BreakerState.COOLED, BreakerState.HALF_OPEN
PERIOD = 10.0


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# Each case: the account's models, the model faulted, and which breaker cools: the account's
# own (model None: an account serving one model) or the (account, model) pair's.
UNITS = [
    pytest.param(("m",), None, id="account"),
    pytest.param(("m", "n"), "m", id="pair"),
]


def cooled_pool(models: tuple[str, ...]) -> tuple[AccountPool, FakeClock, float]:
    """A pool of one account "a" whose breaker (its own, or its pair for "m") just cooled for
    PERIOD seconds; returns the clock time the period ends."""
    clock = FakeClock()
    spec = AccountSpec(
        name="a", models=frozenset(models), failure_threshold=1, cooldown_secs=PERIOD
    )
    pool = AccountPool([spec], clock=clock)
    lease = pool.acquire("m")
    assert lease is not None
    pool.record(lease, Outcome.FAULT)
    return pool, clock, clock.now + PERIOD


def status(pool: AccountPool, model: str | None) -> AccountStatus:
    return pool.status_of("a", model=model)


def seen(pool: AccountPool, model: str | None) -> tuple[BreakerState, bool, bool]:
    s = status(pool, model)
    return s.state, s.probe_in_flight, s.probe_due


def probe(pool: AccountPool) -> Lease:
    lease = pool.acquire("m")
    assert lease is not None
    assert lease.probe
    return lease


@pytest.mark.parametrize(("models", "model"), UNITS)
def test_cooled_while_the_period_runs_half_open_from_its_last_instant(
    models: tuple[str, ...], model: str | None
) -> None:
    pool, clock, end = cooled_pool(models)
    clock.now = end - 0.001
    s = status(pool, model)
    assert (s.state, s.cooled_until, s.probe_due) == (COOLED, end, False)
    clock.now = end  # exactly the period's end: admit() would grant the probe now
    s = status(pool, model)
    assert (s.state, s.cooled_until, s.probe_in_flight, s.probe_due) == (
        HALF_OPEN,
        None,
        False,
        True,
    )
    assert s.cause is Cause.OUTAGE  # still out of rotation until its probe says otherwise
    clock.now = end + 3600.0  # no traffic for an hour: it stays half-open, not cooled
    assert seen(pool, model) == (HALF_OPEN, False, True)


@pytest.mark.parametrize(("models", "model"), UNITS)
def test_reading_the_state_changes_nothing(models: tuple[str, ...], model: str | None) -> None:
    pool, clock, end = cooled_pool(models)
    clock.now = end
    for _ in range(3):
        assert seen(pool, model) == (HALF_OPEN, False, True)
    lease = probe(pool)  # the probe slot is still free for the first request
    assert lease.account == "a"


@pytest.mark.parametrize(("models", "model"), UNITS)
def test_a_probe_out_is_half_open_with_no_probe_due(
    models: tuple[str, ...], model: str | None
) -> None:
    pool, clock, end = cooled_pool(models)
    clock.now = end
    lease = probe(pool)
    assert seen(pool, model) == (HALF_OPEN, True, False)
    pool.record(lease, Outcome.THROTTLE)  # a 429 says nothing: the slot is free again
    assert seen(pool, model) == (HALF_OPEN, False, True)
    lease = probe(pool)
    pool.release(lease)  # the client left: the same
    assert seen(pool, model) == (HALF_OPEN, False, True)


@pytest.mark.parametrize(("models", "model"), UNITS)
def test_a_failed_probe_cools_for_the_next_period_then_half_open_again(
    models: tuple[str, ...], model: str | None
) -> None:
    pool, clock, end = cooled_pool(models)
    clock.now = end + 5.0
    pool.record(probe(pool), Outcome.FAULT)
    again = clock.now + PERIOD  # a young outage keeps its period
    s = status(pool, model)
    assert (s.state, s.cooled_until, s.probe_due) == (COOLED, again, False)
    clock.now = again - 0.001
    assert seen(pool, model) == (COOLED, False, False)
    clock.now = again
    assert seen(pool, model) == (HALF_OPEN, False, True)


@pytest.mark.parametrize(("models", "model"), UNITS)
def test_a_probe_success_closes_it(models: tuple[str, ...], model: str | None) -> None:
    pool, clock, end = cooled_pool(models)
    clock.now = end
    pool.record(probe(pool), Outcome.SUCCESS)
    s = status(pool, model)
    assert (s.state, s.probe_in_flight, s.probe_due, s.cause) == (CLOSED, False, False, None)


def test_a_closed_account_has_no_probe_due() -> None:
    pool = AccountPool([AccountSpec(name="a", models=frozenset({"m"}))], clock=FakeClock())
    assert pool.status() == [AccountStatus("a", CLOSED, 0, None, 30.0, False, None, False)]


def test_the_account_and_its_pair_are_read_apart() -> None:
    """A pair's cooling that ran out does not make the account half-open, nor the reverse."""
    pool, clock, end = cooled_pool(("m", "n"))
    assert seen(pool, None) == (CLOSED, False, False)
    clock.now = end
    assert seen(pool, "m") == (HALF_OPEN, False, True)
    assert seen(pool, None) == (CLOSED, False, False)
    assert seen(pool, "n") == (CLOSED, False, False)
    assert pool.pair_status("a")["m"].probe_due


# --- what another replica reports (a shared store) -----------------------------------------


@pytest.mark.parametrize(("models", "model"), UNITS)
def test_a_probe_another_replica_holds_is_no_probe_due_until_its_lease_ends(
    models: tuple[str, ...], model: str | None
) -> None:
    pool, clock, end = cooled_pool(models)
    clock.now = end
    # Another replica claimed the probe slot for 60 s; the cooling it reports is over.
    pool.merge("a", Shared(1, PERIOD, 0.0, probe_for_secs=60.0), model=model)
    assert seen(pool, model) == (HALF_OPEN, True, False)
    clock.now = end + 59.999
    assert seen(pool, model) == (HALF_OPEN, True, False)
    clock.now = end + 60.0  # its lease ran out with no word: the probe is due again
    assert seen(pool, model) == (HALF_OPEN, False, True)


@pytest.mark.parametrize(("models", "model"), UNITS)
def test_a_cooling_learnt_from_another_replica_turns_half_open_when_it_ends(
    models: tuple[str, ...], model: str | None
) -> None:
    clock = FakeClock()
    spec = AccountSpec(name="a", models=frozenset(models), failure_threshold=1)
    pool = AccountPool([spec], clock=clock)
    pool.merge("a", Shared(1, PERIOD, 4.0, probe_for_secs=0.0), model=model)
    s = status(pool, model)
    assert (s.state, s.cooled_until) == (COOLED, clock.now + 4.0)
    clock.now += 4.0
    assert seen(pool, model) == (HALF_OPEN, False, True)


@pytest.mark.parametrize("left", [0.0, -25.0])
def test_a_cooling_that_ended_before_this_replica_heard_of_it_is_half_open(left: float) -> None:
    """A replica that starts (or reconnects) after a cooling ended with no probe since:
    the store reports the cooling with no time left."""
    clock = FakeClock()
    pool = AccountPool([AccountSpec(name="a", models=frozenset({"m"}))], clock=clock)
    pool.merge("a", Shared(3, PERIOD, left, probe_for_secs=0.0))
    assert seen(pool, None) == (HALF_OPEN, False, True)
    assert probe(pool).account == "a"  # and the probe is indeed due
