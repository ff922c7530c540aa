"""AccountPool.carry_over: a reloaded config's pool keeps the health of unchanged accounts."""

import pytest
from test_pool import FakeClock, fault, spec, take

from switchyard_mw.core.pool import AccountPool, AccountSpec, BreakerState, Cause, Outcome


def pools(
    old_specs: list[AccountSpec], new_specs: list[AccountSpec]
) -> tuple[AccountPool, AccountPool, FakeClock]:
    clock = FakeClock()
    return AccountPool(old_specs, clock=clock), AccountPool(new_specs, clock=clock), clock


def test_a_cooled_account_stays_cooled_for_what_is_left_of_its_cooling() -> None:
    old, new, clock = pools([spec("a", failure_threshold=1, cooldown_secs=30)], [spec("a")])
    fault(old)
    clock.advance(10)
    new.carry_over(old)
    assert new.status_of("a").state is BreakerState.COOLED
    assert new.acquire("m") is None
    assert new.retry_after_secs("m") == pytest.approx(20)
    clock.advance(20)
    lease = take(new)
    assert lease.probe  # the cooling ran its course: one probe, as without the reload


def test_fault_counts_carry_over_toward_the_threshold() -> None:
    old, new, _ = pools([spec("a", failure_threshold=3)], [spec("a", failure_threshold=3)])
    fault(old, 2)
    new.carry_over(old)
    fault(new, 1)
    assert new.status_of("a").state is BreakerState.COOLED


def test_only_the_named_accounts_are_kept() -> None:
    both = [spec("a", failure_threshold=1), spec("b", failure_threshold=1)]
    old, new, _ = pools(both, [spec("a", failure_threshold=1), spec("b", failure_threshold=1)])
    fault(old, 2)  # one fault each: a, then b (round robin)
    assert {s.state for s in old.status()} == {BreakerState.COOLED}
    new.carry_over(old, accounts=["a"])  # b's base_url changed, say: a new account
    assert new.status_of("a").state is BreakerState.COOLED
    assert new.status_of("b").state is BreakerState.CLOSED


def test_new_and_removed_accounts() -> None:
    old, new, _ = pools([spec("a", failure_threshold=1)], [spec("c")])
    fault(old)
    new.carry_over(old)
    assert new.names == ("c",)
    assert new.status_of("c").state is BreakerState.CLOSED


def test_a_probe_in_flight_on_the_old_pool_settles_the_account_in_the_new_one() -> None:
    old, new, clock = pools([spec("a", failure_threshold=1, cooldown_secs=5)], [spec("a")])
    fault(old)
    clock.advance(5)
    probe = take(old)  # a request started before the reload probes the account
    assert probe.probe
    new.carry_over(old)
    assert new.acquire("m") is None  # one probe at a time, across the reload too
    old.record(probe, Outcome.SUCCESS)  # the request ends on the pool it started with
    assert new.status_of("a").state is BreakerState.CLOSED
    assert not take(new).probe


def test_an_old_request_s_fault_counts_in_the_new_pool() -> None:
    old, new, _ = pools([spec("a", failure_threshold=2)], [spec("a", failure_threshold=2)])
    lease = take(old)
    new.carry_over(old)
    fault(new)
    old.record(lease, Outcome.FAULT)
    assert new.status_of("a").state is BreakerState.COOLED


def test_throttle_holds_are_kept_and_later_holds_on_the_old_pool_reach_the_new_one() -> None:
    old, new, clock = pools(
        [spec("a", "m", "n"), spec("b", "m", "n")], [spec("a", "m", "n"), spec("b", "m", "n")]
    )
    old.hold("a", "m", 30)
    clock.advance(10)
    new.carry_over(old)
    assert new.holds_of("a") == {"m": pytest.approx(clock.now + 20)}
    old.hold("b", "n", 5)  # a request still running on the old pool met a 429
    assert new.holds_of("b") == {"n": pytest.approx(clock.now + 5)}


def test_holds_of_accounts_not_kept_are_dropped() -> None:
    old, new, _ = pools([spec("a")], [spec("a")])
    old.hold("a", "m", 30)
    new.carry_over(old, accounts=())
    assert new.holds_of("a") == {}
    old.hold("a", "m", 30)
    assert new.holds_of("a") == {}


def test_the_new_spec_rules_the_kept_state() -> None:
    old, new, clock = pools(
        [spec("a", failure_threshold=1, cooldown_secs=10, max_cooldown_secs=100)],
        [spec("a", failure_threshold=1, cooldown_secs=10, max_cooldown_secs=15)],
    )
    fault(old)
    new.carry_over(old)
    clock.advance(10)
    # The probe meets a refused key: doubled, capped by the new max.
    new.record(take(new), Outcome.FAULT, Cause.CREDENTIALS)
    assert new.status_of("a").current_cooldown_secs == 15
    assert new.retry_after_secs("m") == pytest.approx(15)


def test_a_closed_account_cools_for_the_new_cooldown() -> None:
    old, new, _ = pools(
        [spec("a", failure_threshold=1, cooldown_secs=30)],
        [spec("a", failure_threshold=1, cooldown_secs=5)],
    )
    new.carry_over(old)
    fault(new)
    assert new.retry_after_secs("m") == pytest.approx(5)


def test_models_and_priorities_come_from_the_new_config() -> None:
    old, new, _ = pools(
        [spec("a", "m", priority=0), spec("b", "m", priority=1)],
        [spec("a", "m", priority=1), spec("b", "m", "x", priority=0)],
    )
    assert take(old).account == "a"
    new.carry_over(old)
    assert take(new).account == "b"
    assert new.accounts_for("x") == ("b",)


def test_pools_on_different_clocks_cannot_share_state() -> None:
    old = AccountPool([spec("a")], clock=FakeClock())
    new = AccountPool([spec("a")], clock=FakeClock())
    with pytest.raises(ValueError, match="clock"):
        new.carry_over(old)
