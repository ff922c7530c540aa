"""Each decision is one record where it is made: a cooling (its cause and period), a probe's
end (back in rotation, cooled again, inconclusive), a 429's hold, a fallback, a hedge's end, a
guard trip; and the usual request makes none."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from test_machine_fallbacks import Env as FallbackEnv
from test_machine_fallbacks import refused, where
from test_machine_hedge import RACES, Race, hedged
from test_machine_hedge import Env as HedgeEnv

from switchyard_mw.core.guard import GuardRule
from switchyard_mw.core.pool import AccountPool, AccountSpec, Lease, Outcome
from switchyard_mw.core.variant_buckets import Split
from switchyard_mw.engine.machine import DONE, How
from switchyard_mw.engine.outcomes import hold, probed, settle
from switchyard_mw.engine.variants import Canaries


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    with caplog.at_level(logging.DEBUG, logger="switchyard_mw"):
        yield caplog


def _decisions(records: list[logging.LogRecord]) -> list[dict[str, object]]:
    """Each decision record's event, level and fields."""
    keep = ("event", "account", "model", "cause", "period_secs", "status", "probe", "hold_secs")
    return [
        {"level": r.levelname, **{k: r.__dict__[k] for k in keep if k in r.__dict__}}
        for r in records
        if "event" in r.__dict__
    ]


def _pool(*models: str, threshold: int = 1) -> tuple[AccountPool, FakeClock]:
    clock = FakeClock()
    specs = [
        AccountSpec(name="a", models=frozenset(models or ("m",)), failure_threshold=threshold),
        AccountSpec(name="b", models=frozenset(models or ("m",)), priority=1),
    ]
    return AccountPool(specs, clock=clock), clock


def _take(pool: AccountPool, model: str = "m") -> Lease:
    lease = pool.acquire(model)
    assert lease is not None
    return lease


def test_a_cooling_then_a_failed_probe_then_a_recovery(log: pytest.LogCaptureFixture) -> None:
    pool, clock = _pool(threshold=2)
    settle(pool, _take(pool), Outcome.FAULT, "503")
    assert _decisions(log.records) == []  # one fault of two: no decision yet
    settle(pool, _take(pool), Outcome.FAULT, "502")
    cooled = {"event": "account.cooled", "account": "a", "cause": "outage", "period_secs": 30.0}
    assert _decisions(log.records) == [{"level": "WARNING", **cooled, "status": "502"}]
    clock.now += 30
    probe = _take(pool)
    assert probe.probe
    settle(pool, probe, Outcome.FAULT, "deadline")
    again = {"level": "WARNING", **cooled, "status": "deadline", "probe": "failed"}
    assert _decisions(log.records)[1:] == [again]
    clock.now += 30
    probe = _take(pool)
    settle(pool, probe, Outcome.SUCCESS, "200")
    back = {"level": "INFO", "event": "account.recovered", "account": "a", "probe": "succeeded"}
    assert _decisions(log.records)[2:] == [back]
    # Back in rotation, the usual request decides nothing.
    for _ in range(3):
        settle(pool, _take(pool), Outcome.SUCCESS, "200")
    assert len(_decisions(log.records)) == 3


def test_a_refused_key_cools_the_account_for_every_model(
    log: pytest.LogCaptureFixture,
) -> None:
    pool, _ = _pool("m", "n")
    settle(pool, _take(pool), Outcome.FAULT, "401")
    (cooled,) = _decisions(log.records)
    assert (cooled["cause"], cooled["status"], "model" in cooled) == ("credentials", "401", False)


def test_a_model_fault_cools_the_pair(log: pytest.LogCaptureFixture) -> None:
    pool, clock = _pool("m", "n")
    settle(pool, _take(pool, "m"), Outcome.FAULT, "500")
    (cooled,) = _decisions(log.records)
    assert (cooled["account"], cooled["model"], cooled["cause"]) == ("a", "m", "outage")
    clock.now += 30
    probe = _take(pool, "m")
    assert probe.pair_probe
    probed_before = len(log.records)
    pool.record(probe, Outcome.SUCCESS)
    probed(pool, probe, Outcome.SUCCESS, "200")  # as `Engine.succeeded` does
    (back,) = _decisions(log.records[probed_before:])
    assert (back["event"], back["model"]) == ("account.recovered", "m")


def test_a_throttled_probe_is_inconclusive(log: pytest.LogCaptureFixture) -> None:
    pool, clock = _pool()
    settle(pool, _take(pool), Outcome.FAULT, "500")
    clock.now += 30
    settle(pool, _take(pool), Outcome.THROTTLE, "429")
    assert _decisions(log.records)[1] == {
        "level": "INFO",
        "event": "account.probe",
        "account": "a",
        "probe": "inconclusive",
        "status": "429",
    }


def test_a_hold(log: pytest.LogCaptureFixture) -> None:
    pool, _ = _pool()
    assert hold(pool, "a", "m", [("retry-after", "3")]) == 3.0
    assert _decisions(log.records) == [
        {"level": "INFO", "event": "account.held", "account": "a", "model": "m", "hold_secs": 3.0}
    ]
    hold(pool, "a", "m", [])  # no retry time: nothing held, nothing said
    assert len(_decisions(log.records)) == 1


def test_a_fallback(log: pytest.LogCaptureFixture) -> None:
    env = FallbackEnv()
    m = env.machine()
    m.begin()
    refused(m)
    assert where(m.next()) == ("v", "m-big")
    m.started(200)
    assert m.ended(How.FINISHED) is DONE
    (record,) = [r for r in log.records if r.__dict__.get("event") == "fallback"]
    assert record.levelname == "WARNING"
    fields = (record.__dict__["from_model"], record.__dict__["to_model"], record.__dict__["reason"])
    assert fields == ("m", "m-big", "context_length")


@pytest.mark.parametrize("race", RACES.values(), ids=RACES.keys())
def test_a_hedge_s_end(race: Race, log: pytest.LogCaptureFixture) -> None:
    env = HedgeEnv()
    m = env.machine()
    hedged(env, m)
    race.over(m)
    (record,) = [r for r in log.records if r.__dict__.get("event") == "hedge"]
    assert (record.levelname, record.__dict__["result"]) == ("INFO", race.result)
    assert record.__dict__["account"] == "b"  # the hedge's account, whichever won


def test_a_guard_trip_here_and_from_a_replica(log: pytest.LogCaptureFixture) -> None:
    canaries = Canaries(
        {"base": Split.build("base", [("var", 50.0)], "s")},
        guards={"base": GuardRule(max_fault_rate=0.05, min_requests=1, window_secs=60)},
        clock=FakeClock(),
    )
    canaries.record("var", fault=True)
    canaries.record("var", fault=True)  # tripped already: said once
    trips = [r for r in log.records if r.__dict__.get("event") == "canary.guard_tripped"]
    assert [(r.levelname, r.__dict__["variant"], r.__dict__["tripped_by"]) for r in trips] == [
        ("WARNING", "var", "here")
    ]
    other = Canaries({"base": Split.build("base", [("var", 50.0)], "s")}, guards={})
    other.trip("base", "var", announce=False)
    trips = [r for r in log.records if r.__dict__.get("event") == "canary.guard_tripped"]
    assert trips[-1].__dict__["tripped_by"] == "replica"
