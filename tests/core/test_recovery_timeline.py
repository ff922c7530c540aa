"""How soon a primary that healed is used again, and how often one that stays broken is
probed: timelines through the pool with an injected clock (the defaults: 3 faults in a row,
cooldown 30 s, max 300 s), a request every 4 s, a spare account of lower priority.
"""

from __future__ import annotations

import itertools

import pytest
from test_pool import FakeClock

from switchyard_mw.core.pool import AccountPool, AccountSpec, Cause, Outcome

GAP = 4.0


def accounts(**kw: float) -> list[AccountSpec]:
    return [
        AccountSpec(name="primary", models=frozenset({"m"}), **kw),  # type: ignore[arg-type]
        AccountSpec(name="spare", models=frozenset({"m"}), priority=1),
    ]


def run(down_secs: float, horizon: float, cause: Cause = Cause.OUTAGE, **kw: float) -> list[float]:
    """A request every GAP s from 0 to `horizon`: each tries the primary first, which fails
    (with `cause`) until `down_secs`; the times at which the primary was tried."""
    clock = FakeClock(0.0)
    pool = AccountPool(accounts(**kw), clock=clock)
    tried = []
    while clock.now <= horizon:
        lease = pool.acquire("m")
        assert lease is not None
        if lease.account == "primary":
            tried.append(clock.now)
            if clock.now < down_secs:
                pool.record(lease, Outcome.FAULT, cause)
                spare = pool.acquire("m", exclude={"primary"})
                assert spare is not None
                pool.record(spare, Outcome.SUCCESS)
            else:
                pool.record(lease, Outcome.SUCCESS)
        else:
            pool.record(lease, Outcome.SUCCESS)
        clock.advance(GAP)
    return tried


def back_after(down_secs: float) -> float:
    """Seconds from the primary's healing to its first request served."""
    return next(t for t in run(down_secs, down_secs + 400) if t >= down_secs) - down_secs


def test_the_issues_timeline_a_primary_down_60_s_is_back_12_s_after_it_healed() -> None:
    tried = run(60.0, 120.0)
    # Faults at 0, 4, 8 (cooled 30 s), the probe at 40 fails (re-cooled 30 s, not 60 s),
    # the probe at 72 succeeds; from then on every request goes to the primary.
    assert tried[:5] == [0.0, 4.0, 8.0, 40.0, 72.0]
    assert tried[4:] == [72.0 + GAP * i for i in range(len(tried) - 4)]
    assert back_after(60.0) == 12.0  # it was 40 s: the doubled 60 s cooling, probe at 100


@pytest.mark.parametrize("down_secs", [float(s) for s in range(1, 300, 7)])
def test_an_outage_shorter_than_max_cooldown_is_over_within_one_period_and_a_gap(
    down_secs: float,
) -> None:
    assert back_after(down_secs) <= 30.0 + GAP


def test_a_primary_that_stays_broken_reaches_todays_steady_probe_rate() -> None:
    hours = 3 * 3600.0
    tried = run(hours + 1, hours)
    probes = tried[3:]  # after the 3 faults that cooled it
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    # The first 300 s every 30 s (+ the wait for the next request), then doubling to the cap.
    assert all(30.0 <= g <= 30.0 + GAP for g in gaps[:9])
    assert gaps[9:13] == pytest.approx([60.0, 120.0, 240.0, 300.0], abs=GAP)
    steady = [g for a, g in zip(probes, gaps, strict=False) if a > 3600]
    assert steady
    assert min(steady) >= 300.0  # no more often than every max_cooldown_secs, as before
    # The cost of the early return: a fixed number of extra failed probes in the outage's
    # first minutes, against the rule of before (doubling from the first failed probe, as a
    # refused key still does), whatever the outage's length.
    before = run(hours + 1, hours, Cause.CREDENTIALS)[3:]
    assert len(probes) - len(before) == 8
    assert (
        len(run(2 * hours + 1, 2 * hours)[3:])
        - len(run(2 * hours + 1, 2 * hours, Cause.CREDENTIALS)[3:])
        == 8
    )


def test_a_refused_key_doubles_at_once_as_before() -> None:
    tried = run(10_000.0, 1_000.0, Cause.CREDENTIALS)
    probes = tried[3:]
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert gaps[:3] == pytest.approx([60.0, 120.0, 240.0], abs=GAP)
