"""AccountPool with a store attached, sans-IO: what it tells the store, how it merges replies."""

from __future__ import annotations

from test_pool import FakeClock, spec

from switchyard_mw.core.pool import AccountPool, BreakerState, Cause, Lease, Outcome, Recovery
from switchyard_mw.core.shared import Change, Shared
from switchyard_mw.engine.claims import acquire_shared


class FakeStore:
    """Records every change; answers claims from a script (None = granted)."""

    def __init__(self) -> None:
        self.changes: list[tuple[str, Change, Shared]] = []
        self.claims: list[str] = []
        self.answers: dict[str, Shared | None] = {}
        self.holds: list[tuple[str, str, float]] = []

    def changed(
        self, account: str, change: Change, local: Shared, *, model: str | None = None
    ) -> None:
        self.changes.append((account, change, local))

    def held(self, account: str, model: str, until_unix: float) -> None:
        self.holds.append((account, model, until_unix))

    async def claim_probe(self, account: str, model: str | None = None) -> Shared | None:
        self.claims.append(account)
        return self.answers.get(account)


def shared_pool(*specs: object) -> tuple[AccountPool, FakeClock, FakeStore]:
    clock, store = FakeClock(), FakeStore()
    pool = AccountPool(
        specs or (spec("a", failure_threshold=2), spec("b", priority=1)), clock=clock
    )  # type: ignore[arg-type]
    pool.attach(store)
    return pool, clock, store


async def take(pool: AccountPool, **kw: object) -> Lease:
    lease = await acquire_shared(pool, "m", **kw)  # type: ignore[arg-type]
    assert lease is not None
    return lease


async def test_a_success_on_a_healthy_account_never_reaches_the_store() -> None:
    pool, _, store = shared_pool()
    for _ in range(100):
        pool.record(await take(pool), Outcome.SUCCESS)
    pool.record(await take(pool), Outcome.THROTTLE)
    pool.release(await take(pool))
    assert store.changes == []
    assert store.claims == []


async def test_state_changing_outcomes_are_told_with_the_local_view() -> None:
    pool, clock, store = shared_pool()
    pool.record(await take(pool, allowed={"a"}), Outcome.FAULT)
    pool.record(await take(pool, allowed={"a"}), Outcome.SUCCESS)
    pool.record(await take(pool, allowed={"a"}), Outcome.FAULT)
    pool.record(await take(pool, allowed={"a"}), Outcome.FAULT)  # cools (threshold 2)
    kinds = [(name, change) for name, change, _ in store.changes]
    assert kinds == [
        ("a", Change.FAULT),
        ("a", Change.RESET),
        ("a", Change.FAULT),
        ("a", Change.FAULT),
    ]
    assert store.changes[-1][2] == Shared(2, 30.0, 30.0)
    clock.advance(30)
    probe = await take(pool, allowed={"a"})
    assert probe.probe
    assert store.claims == ["a"]
    pool.record(probe, Outcome.SUCCESS)
    assert store.changes[-1][1] is Change.PROBE_SUCCESS


async def test_a_probe_held_elsewhere_is_skipped_for_the_next_account() -> None:
    pool, clock, store = shared_pool(spec("a", failure_threshold=1), spec("b", priority=1))
    pool.record(await take(pool), Outcome.FAULT)
    clock.advance(30)
    store.answers["a"] = Shared(1, 30.0, 0.0, probe_for_secs=5.0)
    lease = await take(pool)
    assert (lease.account, lease.probe) == ("b", False)
    assert pool.status_of("a").probe_in_flight
    assert pool.retry_after_secs("m", allowed={"a"}) == 1.0
    assert (await take(pool)).account == "b"
    assert store.claims == ["a"]  # learnt once: no second round trip while it is held
    clock.advance(5)
    store.answers["a"] = None
    assert (await take(pool)).probe


async def test_a_longer_shared_cooling_is_adopted_on_a_refused_claim() -> None:
    pool, clock, store = shared_pool(spec("a", failure_threshold=1))
    pool.record(await take(pool), Outcome.FAULT)
    clock.advance(30)
    store.answers["a"] = Shared(1, 60.0, 45.0)
    assert await acquire_shared(pool, "m") is None
    assert pool.status_of("a").cooled_until == clock.now + 45
    assert pool.status_of("a").current_cooldown_secs == 60


def test_merge_never_moves_a_cooling_end_earlier() -> None:
    pool, clock, _ = shared_pool(spec("a", failure_threshold=1))
    pool.merge("a", Shared(1, 60.0, 60.0))
    assert pool.status_of("a").state is BreakerState.COOLED
    pool.merge("a", Shared(1, 30.0, 10.0))
    assert pool.status_of("a").cooled_until == clock.now + 60
    assert pool.status_of("a").current_cooldown_secs == 60
    pool.merge("a", Shared(0, 30.0, None))  # a count update does not end a cooling
    assert pool.status_of("a").state is BreakerState.COOLED
    pool.merge("a", Shared(0, 30.0, None, closed=True))  # a probe succeeded elsewhere
    status = pool.status_of("a")
    assert (status.state, status.current_cooldown_secs) == (BreakerState.CLOSED, 30.0)
    pool.merge("unknown", Shared(1, 1.0, 1.0))  # another replica's newer config: ignored


def test_view_reports_the_local_state() -> None:
    pool, clock, _ = shared_pool(spec("a", failure_threshold=1))
    assert pool.view("a") == Shared(0, 30.0, None)
    lease = pool.acquire("m")
    assert lease is not None
    pool.record(lease, Outcome.FAULT)
    clock.advance(10)
    assert pool.view("a") == Shared(1, 30.0, 20.0)


def test_a_hold_is_told_to_the_store_once_with_its_end_in_unix_time() -> None:
    pool, _, store = shared_pool()
    assert pool.hold("a", "m", 20.0, wall_now=1_000_000.0) == 20.0
    assert store.holds == [("a", "m", 1_000_020.0)]
    pool.hold("a", "m", 20.0)  # no Unix time: local only (a test, or a caller that cannot date it)
    assert len(store.holds) == 1


def test_a_hold_from_another_replica_is_applied_but_not_told_back() -> None:
    pool, clock, store = shared_pool()
    pool.merge_hold("a", "m", 5.0)
    pool.merge_hold("nobody", "m", 5.0)  # a newer config elsewhere: ignored
    assert store.holds == []
    lease = pool.acquire("m")
    assert lease is not None
    assert lease.account == "b"
    clock.now += 5.0
    lease = pool.acquire("m")
    assert lease is not None
    assert lease.account == "a"


def test_a_cooling_learnt_from_the_store_keeps_its_cause() -> None:
    pool, clock, _ = shared_pool(spec("a"))
    pool.merge("a", Shared(3, 30.0, 25.0, cause=Cause.CREDENTIALS))
    assert pool.status_of("a").cause is Cause.CREDENTIALS
    assert pool.view("a").cause is Cause.CREDENTIALS
    pool.merge("a", Shared(3, 30.0, 10.0))  # a shorter outage's cooling: the longer one stays
    assert pool.status_of("a").cause is Cause.CREDENTIALS
    clock.advance(5.0)
    pool.merge("a", Shared(4, 60.0, 60.0))  # ends last: it says why from now on
    assert pool.status_of("a").cause is Cause.OUTAGE
    assert pool.recovery("m") == Recovery(60.0, None)
