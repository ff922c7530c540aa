"""AccountPool: breaker state machine, selection order, retry-after and status snapshots."""

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from switchyard_mw.core.pool import (
    PROBE_RETRY_AFTER_SECS,
    AccountPool,
    AccountSpec,
    AccountStatus,
    BreakerState,
    Cause,
    Lease,
    Outcome,
    Recovery,
    classify_status,
    fault_cause,
)


class FakeClock:
    """Monotonic seconds that only move when a test says so."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, secs: float) -> None:
        self.now += secs


def spec(name: str, *models: str, **kw: object) -> AccountSpec:
    return AccountSpec(name=name, models=frozenset(models or ("m",)), **kw)  # type: ignore[arg-type]


def make(*specs: AccountSpec) -> tuple[AccountPool, FakeClock]:
    clock = FakeClock()
    return AccountPool(specs, clock=clock), clock


def take(pool: AccountPool, model: str = "m", **kw: object) -> Lease:
    lease = pool.acquire(model, **kw)  # type: ignore[arg-type]
    assert lease is not None
    return lease


def fault(pool: AccountPool, n: int = 1, model: str = "m") -> None:
    for _ in range(n):
        pool.record(take(pool, model), Outcome.FAULT)


def cool_single(threshold: int = 1, **kw: object) -> tuple[AccountPool, FakeClock]:
    """A one-account pool ("a" serving "m") that is COOLED right now."""
    pool, clock = make(spec("a", failure_threshold=threshold, **kw))
    fault(pool, threshold)
    assert pool.status_of("a").state is BreakerState.COOLED
    return pool, clock


# --- classification and config -------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "outcome"),
    [
        (401, Outcome.FAULT),
        (402, Outcome.FAULT),
        (403, Outcome.FAULT),
        (500, Outcome.FAULT),
        (502, Outcome.FAULT),
        (503, Outcome.FAULT),
        (504, Outcome.FAULT),
        (529, Outcome.FAULT),
        (429, Outcome.THROTTLE),
        (400, Outcome.SUCCESS),
        (404, Outcome.SUCCESS),
        (200, Outcome.SUCCESS),
    ],
)
def test_classify_status(status: int, outcome: Outcome) -> None:
    assert classify_status(status) is outcome


def test_spec_serves_and_normalises_models() -> None:
    s = AccountSpec(name="a", models=["x", "y"])  # type: ignore[arg-type]
    assert s.models == frozenset({"x", "y"})
    assert s.serves("x")
    assert not s.serves("z")
    assert AccountSpec(name="w", models=frozenset({"*"})).serves("anything")


@pytest.mark.parametrize(
    "kw",
    [
        {"models": "gpt-4o"},
        {"failure_threshold": 0},
        {"cooldown_secs": 0.0},
        {"cooldown_secs": 10.0, "max_cooldown_secs": 5.0},
    ],
)
def test_spec_rejects_bad_config(kw: dict[str, object]) -> None:
    args: dict[str, object] = {"name": "a", "models": frozenset({"m"}), **kw}
    with pytest.raises((ValueError, TypeError)):
        AccountSpec(**args)  # type: ignore[arg-type]


def test_duplicate_account_names_rejected() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        AccountPool([spec("a"), spec("a")])


# --- breaker state machine -----------------------------------------------------------------


def test_cools_at_exactly_failure_threshold() -> None:
    pool, clock = make(spec("a", failure_threshold=3, cooldown_secs=30.0))
    fault(pool, 2)
    st_ = pool.status_of("a")
    assert (st_.state, st_.consecutive_faults, st_.cooled_until) == (BreakerState.CLOSED, 2, None)
    fault(pool)
    st_ = pool.status_of("a")
    assert st_.state is BreakerState.COOLED
    assert st_.cooled_until == clock.now + 30.0
    assert pool.acquire("m") is None


def test_success_resets_fault_count() -> None:
    pool, _ = make(spec("a", failure_threshold=3))
    fault(pool, 2)
    pool.record(take(pool), Outcome.SUCCESS)
    assert pool.status_of("a").consecutive_faults == 0
    fault(pool, 2)
    assert pool.status_of("a").state is BreakerState.CLOSED


def test_a_success_on_a_pair_with_a_fault_resets_the_pair_not_only_the_account() -> None:
    pool, _ = make(spec("a", "m", "n", failure_threshold=2))  # two models: faults per pair
    fault(pool, 1, model="m")
    assert pool.pairs() == [("a", "m")]
    pool.record(take(pool, "n"), Outcome.SUCCESS)  # another model's success: the pair stays
    assert pool.pairs() == [("a", "m")]
    pool.record(take(pool, "m"), Outcome.SUCCESS)
    assert pool.pairs() == []
    fault(pool, 1, model="m")
    assert pool.status_of("a", model="m").state is BreakerState.CLOSED  # counted from 0


def test_a_plain_grant_is_one_lease_per_account_and_model_a_probe_its_own() -> None:
    pool, clock = make(spec("a", "m", "n", failure_threshold=1, cooldown_secs=5))
    assert take(pool, "m") is take(pool, "m")
    assert take(pool, "m") is not take(pool, "n")
    fault(pool, 1, model="m")
    clock.advance(5)
    probe = take(pool, "m")
    assert probe.probe
    assert probe is not take(pool, "n")


@pytest.mark.parametrize(
    ("priorities", "keyed"), [((0, 1), False), ((0, 0), True), ((1, 1), True), ((0,), False)]
)
def test_a_key_matters_only_where_a_priority_has_several_accounts(
    priorities: tuple[int, ...], keyed: bool
) -> None:
    """A key given as a function is worked out only where it can change the choice."""
    pool, _ = make(*(spec(f"a{i}", priority=p) for i, p in enumerate(priorities)))
    asked: list[str] = []

    def key() -> int:
        asked.append("m")
        return 7

    assert pool.acquire("m", key=key) is not None
    assert asked == (["m"] if keyed else [])
    assert pool.acquire("unserved", key=key) is None
    assert len(asked) == (1 if keyed else 0)


def test_a_key_function_that_finds_none_takes_turns() -> None:
    pool, _ = make(spec("a0"), spec("a1"))
    names = [pool.acquire("m", key=lambda: None) for _ in range(4)]
    assert [lease.account for lease in names if lease is not None] == ["a0", "a1", "a0", "a1"]


def test_cooling_blocks_until_period_elapses_then_admits_a_probe() -> None:
    pool, clock = cool_single(cooldown_secs=10.0)
    clock.advance(9.999)
    assert pool.acquire("m") is None
    clock.advance(0.001)
    lease = take(pool)
    assert lease.probe
    st_ = pool.status_of("a")
    assert st_.state is BreakerState.HALF_OPEN
    assert st_.probe_in_flight
    assert st_.cooled_until is None


def failed_probes(pool: AccountPool, clock: FakeClock, n: int, cause: Cause) -> list[float]:
    """The period after each of `n` failed probes, each sent when its cooling ends."""
    periods = []
    for _ in range(n):
        clock.advance(pool.status_of("a").current_cooldown_secs)
        probe = take(pool)
        assert probe.probe
        pool.record(probe, Outcome.FAULT, cause)
        st_ = pool.status_of("a")
        assert st_.state is BreakerState.COOLED
        assert st_.cooled_until == clock.now + st_.current_cooldown_secs
        periods.append(st_.current_cooldown_secs)
    return periods


def test_an_outage_keeps_its_period_until_it_is_max_cooldown_old_then_doubles_to_max() -> None:
    pool, clock = cool_single(cooldown_secs=10.0, max_cooldown_secs=35.0)
    # Probes at 10, 20, 30 s of the outage: younger than 35 s, the period stays; at 40 s
    # and after, it doubles up to the cap.
    periods = failed_probes(pool, clock, 6, Cause.OUTAGE)
    assert periods == [10.0, 10.0, 10.0, 20.0, 35.0, 35.0]


def test_the_outage_age_boundary_is_max_cooldown_exactly() -> None:
    pool, clock = cool_single(cooldown_secs=10.0, max_cooldown_secs=20.0)
    clock.advance(10.0)
    pool.record(take(pool), Outcome.FAULT)  # 10 s old: kept
    clock.advance(9.999)
    assert pool.acquire("m") is None
    clock.advance(0.001)
    pool.record(take(pool), Outcome.FAULT)  # 20 s old, = max_cooldown_secs: doubled
    assert pool.status_of("a").current_cooldown_secs == 20.0


def test_a_refused_key_doubles_from_its_first_failed_probe() -> None:
    pool, clock = make(spec("a", failure_threshold=1, cooldown_secs=10.0, max_cooldown_secs=35.0))
    pool.record(take(pool), Outcome.FAULT, Cause.CREDENTIALS)
    periods = failed_probes(pool, clock, 4, Cause.CREDENTIALS)
    assert periods == [20.0, 35.0, 35.0, 35.0]


def test_a_new_outage_after_a_success_starts_young_again() -> None:
    pool, clock = cool_single(cooldown_secs=10.0, max_cooldown_secs=20.0)
    failed_probes(pool, clock, 3, Cause.OUTAGE)  # 10, 20 (doubled at 20 s), 20
    clock.advance(20.0)
    pool.record(take(pool), Outcome.SUCCESS)
    fault(pool)
    assert failed_probes(pool, clock, 1, Cause.OUTAGE) == [10.0]


def test_probe_success_closes_and_resets_period() -> None:
    pool, clock = cool_single(cooldown_secs=10.0)
    clock.advance(10.0)
    pool.record(take(pool), Outcome.FAULT)  # probe fault: period 20
    clock.advance(20.0)
    probe = take(pool)
    pool.record(probe, Outcome.SUCCESS)
    assert pool.status_of("a") == AccountStatus("a", BreakerState.CLOSED, 0, None, 10.0, False)
    assert not take(pool).probe
    # The next cooling starts from the base period again.
    fault(pool)
    assert pool.status_of("a").cooled_until == clock.now + 10.0


def test_probe_fault_recools_even_below_threshold() -> None:
    pool, clock = cool_single(threshold=3, cooldown_secs=10.0)
    clock.advance(10.0)
    pool.record(take(pool), Outcome.FAULT)
    st_ = pool.status_of("a")
    assert st_.state is BreakerState.COOLED
    assert st_.current_cooldown_secs == 10.0  # a young outage keeps its period
    assert st_.cooled_until == clock.now + 10.0


def test_only_one_probe_in_flight() -> None:
    pool, clock = make(spec("a", failure_threshold=1), spec("b", priority=1))
    pool.record(take(pool), Outcome.FAULT)
    clock.advance(30.0)
    first = take(pool)
    assert (first.account, first.probe) == ("a", True)
    second = take(pool)
    assert (second.account, second.probe) == ("b", False)
    assert pool.acquire("m", exclude={"b"}) is None


def test_release_frees_the_probe_slot_only() -> None:
    pool, clock = cool_single(cooldown_secs=10.0)
    clock.advance(10.0)
    probe = take(pool)
    pool.release(probe)
    st_ = pool.status_of("a")
    assert (st_.state, st_.probe_in_flight, st_.consecutive_faults) == (
        BreakerState.HALF_OPEN,
        False,
        1,
    )
    again = take(pool)
    assert again.probe
    # The released lease is stale: recording it must not settle the live probe.
    pool.record(probe, Outcome.SUCCESS)
    assert pool.status_of("a").state is BreakerState.HALF_OPEN
    assert pool.status_of("a").probe_in_flight
    pool.record(again, Outcome.SUCCESS)
    assert pool.status_of("a").state is BreakerState.CLOSED


def test_throttle_never_counts_or_cools() -> None:
    pool, _ = make(spec("a", failure_threshold=1))
    for _ in range(10):
        pool.record(take(pool), Outcome.THROTTLE)
    assert pool.status_of("a") == AccountStatus("a", BreakerState.CLOSED, 0, None, 30.0, False)


def test_throttle_keeps_fault_count() -> None:
    pool, _ = make(spec("a", failure_threshold=3))
    fault(pool, 2)
    pool.record(take(pool), Outcome.THROTTLE)
    assert pool.status_of("a").consecutive_faults == 2
    fault(pool)
    assert pool.status_of("a").state is BreakerState.COOLED


def test_throttled_probe_frees_slot_and_stays_half_open() -> None:
    pool, clock = cool_single(cooldown_secs=10.0)
    clock.advance(10.0)
    pool.record(take(pool), Outcome.THROTTLE)
    st_ = pool.status_of("a")
    assert (st_.state, st_.probe_in_flight, st_.current_cooldown_secs) == (
        BreakerState.HALF_OPEN,
        False,
        10.0,
    )
    assert take(pool).probe


def test_straggler_fault_during_cooling_changes_nothing_but_the_count() -> None:
    pool, clock = make(spec("a", failure_threshold=2, cooldown_secs=10.0))
    stragglers = [take(pool) for _ in range(3)]
    pool.record(stragglers[0], Outcome.FAULT)
    pool.record(stragglers[1], Outcome.FAULT)
    until = pool.status_of("a").cooled_until
    clock.advance(5.0)
    pool.record(stragglers[2], Outcome.FAULT)
    st_ = pool.status_of("a")
    assert (st_.state, st_.cooled_until, st_.current_cooldown_secs, st_.consecutive_faults) == (
        BreakerState.COOLED,
        until,
        10.0,
        3,
    )


def test_straggler_during_probe_does_not_settle_it() -> None:
    pool, clock = make(spec("a", failure_threshold=1, cooldown_secs=10.0))
    straggler_fault, straggler_ok = take(pool), take(pool)
    pool.record(take(pool), Outcome.FAULT)
    clock.advance(10.0)
    probe = take(pool)
    pool.record(straggler_fault, Outcome.FAULT)
    pool.record(straggler_ok, Outcome.SUCCESS)
    st_ = pool.status_of("a")
    assert (st_.state, st_.probe_in_flight) == (BreakerState.HALF_OPEN, True)
    pool.record(probe, Outcome.SUCCESS)
    assert pool.status_of("a").state is BreakerState.CLOSED


# --- selection -----------------------------------------------------------------------------


def test_priority_order_and_failover_to_next_group() -> None:
    pool, _ = make(spec("low", priority=5), spec("high", priority=1), spec("mid", priority=3))
    assert pool.accounts_for("m") == ("high", "mid", "low")
    assert [take(pool).account for _ in range(3)] == ["high"] * 3
    assert take(pool, exclude={"high"}).account == "mid"
    assert take(pool, exclude={"high", "mid"}).account == "low"
    assert pool.acquire("m", exclude={"high", "mid", "low"}) is None


def test_equal_priority_round_robin_spreads_evenly() -> None:
    pool, _ = make(spec("a"), spec("b"), spec("c"), spec("backup", priority=1))
    counts = Counter(take(pool).account for _ in range(300))
    assert counts == {"a": 100, "b": 100, "c": 100}


def test_round_robin_skips_cooled_member() -> None:
    pool, _ = make(spec("a", failure_threshold=1), spec("b"), spec("c"))
    pool.record(take(pool, allowed={"a"}), Outcome.FAULT)
    counts = Counter(take(pool).account for _ in range(100))
    assert counts == {"b": 50, "c": 50}


def test_exclude_and_allowed_are_honoured() -> None:
    pool, _ = make(spec("a"), spec("b"), spec("c", priority=1))
    assert {take(pool, allowed={"b", "c"}).account for _ in range(10)} == {"b"}
    assert pool.acquire("m", allowed={"a", "b"}, exclude={"a", "b"}) is None
    assert take(pool, allowed={"c"}).account == "c"
    assert pool.acquire("m", allowed=()) is None


def test_wildcard_accounts() -> None:
    pool, _ = make(spec("x", "gpt"), spec("any", "*", priority=1), spec("y", "claude"))
    assert pool.accounts_for("gpt") == ("x", "any")
    assert pool.accounts_for("unknown") == ("any",)
    assert take(pool, "gpt").account == "x"
    assert take(pool, "gpt", exclude={"x"}).account == "any"
    assert take(pool, "never-configured").account == "any"
    only_explicit, _ = make(spec("x", "gpt"))
    assert only_explicit.accounts_for("other") == ()
    assert only_explicit.acquire("other") is None


def test_a_wildcard_accounts_model_faults_are_per_model_and_refusals_shared() -> None:
    pool, _ = make(spec("any", "*", failure_threshold=1), spec("x", "gpt", priority=1))
    pool.record(take(pool, "foo"), Outcome.FAULT)  # a 5xx for foo
    assert pool.acquire("foo") is None
    assert take(pool, "bar").account == "any"
    pool.record(take(pool, "bar"), Outcome.FAULT, Cause.CREDENTIALS)  # a refused key
    assert pool.acquire("bar") is None
    assert pool.acquire("baz") is None
    assert take(pool, "gpt").account == "x"


# --- retry-after and status ----------------------------------------------------------------


def test_retry_after_earliest_cooled_account_wins() -> None:
    pool, clock = make(
        spec("a", failure_threshold=1, cooldown_secs=30.0),
        spec("b", failure_threshold=1, cooldown_secs=10.0),
    )
    pool.record(take(pool, allowed={"a"}), Outcome.FAULT)
    clock.advance(5.0)
    pool.record(take(pool, allowed={"b"}), Outcome.FAULT)
    assert pool.retry_after_secs("m") == pytest.approx(10.0)  # b: 10 left, a: 25 left
    assert pool.retry_after_secs("m", allowed={"a"}) == pytest.approx(25.0)
    clock.advance(4.0)
    assert pool.retry_after_secs("m") == pytest.approx(6.0)
    clock.advance(6.0)
    assert pool.retry_after_secs("m") == 0.0


def test_retry_after_special_cases() -> None:
    pool, clock = cool_single(cooldown_secs=10.0)
    assert pool.retry_after_secs("nobody-serves-this") is None
    clock.advance(10.0)
    probe = take(pool)
    assert pool.retry_after_secs("m") == PROBE_RETRY_AFTER_SECS
    pool.release(probe)
    assert pool.retry_after_secs("m") == 0.0  # half-open, slot free
    healthy, _ = make(spec("a"))
    assert healthy.retry_after_secs("m") == 0.0


def test_status_snapshot_in_config_order() -> None:
    pool, clock = make(
        spec("z", priority=2),
        spec("a", failure_threshold=1, cooldown_secs=7.0, max_cooldown_secs=9.0),
    )
    pool.record(take(pool, allowed={"a"}), Outcome.FAULT)
    assert pool.status() == [
        AccountStatus("z", BreakerState.CLOSED, 0, None, 30.0, False),
        AccountStatus("a", BreakerState.COOLED, 1, clock.now + 7.0, 7.0, False, Cause.OUTAGE),
    ]
    with pytest.raises(KeyError):
        pool.status_of("missing")


# --- why an account cools: refused credentials or an outage ---------------------------------


@pytest.mark.parametrize(
    ("status", "cause"),
    [
        ("401", Cause.CREDENTIALS),
        ("402", Cause.CREDENTIALS),
        ("403", Cause.CREDENTIALS),
        ("400", Cause.OUTAGE),  # never a fault, but not a refusal either
        ("500", Cause.OUTAGE),
        ("529", Cause.OUTAGE),
        ("deadline", Cause.OUTAGE),
        ("connect_error", Cause.OUTAGE),
        ("no_response", Cause.OUTAGE),
    ],
)
def test_fault_cause_by_status(status: str, cause: Cause) -> None:
    assert fault_cause(status) is cause


def test_the_fault_that_cools_an_account_says_why() -> None:
    pool, clock = make(spec("a", failure_threshold=2, cooldown_secs=10.0))
    pool.record(take(pool), Outcome.FAULT, Cause.OUTAGE)
    assert pool.status_of("a").cause is None  # closed: not out of rotation
    straggler = take(pool)
    pool.record(take(pool), Outcome.FAULT, Cause.CREDENTIALS)  # the second in a row cools it
    assert pool.status_of("a").cause is Cause.CREDENTIALS
    pool.record(straggler, Outcome.FAULT, Cause.OUTAGE)  # sent before: changes nothing
    assert pool.status_of("a").cause is Cause.CREDENTIALS
    clock.advance(10.0)
    pool.record(take(pool), Outcome.FAULT, Cause.OUTAGE)  # the probe: the provider is down
    assert pool.status_of("a").cause is Cause.OUTAGE
    clock.advance(20.0)
    pool.record(take(pool), Outcome.SUCCESS)
    assert pool.status_of("a").cause is None


def test_recovery_tells_refused_keys_from_what_heals() -> None:
    pool, clock = make(
        spec("a", failure_threshold=1, cooldown_secs=30.0),
        spec("b", failure_threshold=1, cooldown_secs=50.0),
        spec("c", "other"),
    )
    assert pool.recovery("nobody-serves-this") is None
    assert pool.recovery("m") == Recovery(0.0, None)
    pool.record(take(pool, allowed={"a"}), Outcome.FAULT, Cause.CREDENTIALS)
    assert pool.recovery("m") == Recovery(0.0, 30.0)  # b serves now
    pool.record(take(pool, allowed={"b"}), Outcome.FAULT, Cause.OUTAGE)
    assert pool.recovery("m") == Recovery(50.0, 30.0)
    assert pool.recovery("m", allowed={"a"}) == Recovery(None, 30.0)
    pool.hold("a", "m", 45.0)  # held and refused: it stays refused, back when both are over
    clock.advance(10.0)
    assert pool.recovery("m") == Recovery(40.0, 35.0)
    assert pool.retry_after_secs("m") == 35.0  # what failover asks: causes aside


# --- property: invariants under random traffic ---------------------------------------------

SPECS = (
    AccountSpec(name="a", models=frozenset({"m"}), failure_threshold=1, cooldown_secs=1.0),
    AccountSpec(
        name="b", models=frozenset({"*"}), failure_threshold=2, cooldown_secs=2.0,
        max_cooldown_secs=5.0,
    ),
    AccountSpec(name="c", models=frozenset({"m"}), priority=1, failure_threshold=3),
)  # fmt: skip


class PoolMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self) -> None:
        self.clock = FakeClock(0.0)
        self.pool = AccountPool(SPECS, clock=self.clock)
        self.leases: list[Lease] = []
        # Latest cooling end seen per account: cooling end may only ever move later.
        self.until: dict[str, float] = {}

    @rule(model=st.sampled_from(["m", "other"]), exclude=st.sets(st.sampled_from("abc")))
    def acquire(self, model: str, exclude: set[str]) -> None:
        lease = self.pool.acquire(model, exclude=exclude)
        if lease is not None:
            assert lease.account not in exclude
            self.leases.append(lease)

    @rule(data=st.data(), outcome=st.sampled_from(list(Outcome)))
    def record(self, data: st.DataObject, outcome: Outcome) -> None:
        if self.leases:
            i = data.draw(st.integers(0, len(self.leases) - 1))
            self.pool.record(self.leases.pop(i), outcome)

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        if self.leases:
            i = data.draw(st.integers(0, len(self.leases) - 1))
            self.pool.release(self.leases.pop(i))

    @rule(secs=st.floats(0.0, 20.0))
    def advance(self, secs: float) -> None:
        self.clock.advance(secs)

    @invariant()
    def breaker_invariants(self) -> None:
        for s in SPECS:
            now = self.pool.status_of(s.name)
            assert s.cooldown_secs <= now.current_cooldown_secs <= s.max_cooldown_secs
            assert (now.cooled_until is not None) == (now.state is BreakerState.COOLED)
            # Cooled only while the period runs; half-open from its end, the probe due until
            # one is out.
            assert now.cooled_until is None or now.cooled_until > self.clock.now
            half_open = now.state is BreakerState.HALF_OPEN
            assert now.probe_due == (half_open and not now.probe_in_flight)
            if now.cooled_until is not None:
                assert now.cooled_until >= self.until.get(s.name, now.cooled_until)
                self.until[s.name] = now.cooled_until
            # One probe at most per breaker: the account's own, and each pair's.
            for unit in (None, "m", "other"):
                if unit is not None and not s.serves(unit):
                    continue
                st_ = self.pool.status_of(s.name, model=unit)
                probes = sum(
                    1
                    for lease in self.leases
                    if lease.account == s.name and lease.probe and lease.unit == unit
                )
                assert probes <= 1
                assert st_.probe_in_flight == (probes == 1)
                if st_.probe_in_flight:
                    assert st_.state is BreakerState.HALF_OPEN


PoolMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)
test_pool_invariants = PoolMachine.TestCase
