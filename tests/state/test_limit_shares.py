"""A replica's shares of the limits while the shared store is down: each limit divided by
`replicas_hint`, starting from the replica's share of what it last read, raised again in each
new outage, and what it reserved beyond that handed over once for the merge."""

from __future__ import annotations

from switchyard_mw.core.limits import Granted, LimitKey, Measure, Refused
from switchyard_mw.state._limit_shares import Shares

DAY = LimitKey(scope="t", measure=Measure.TOKENS, per="day", amount=1000)
START = 86400.0 * 20_000


class Clock:
    now = START + 100.0

    def __call__(self) -> float:
        return self.now


async def test_a_share_starts_from_its_part_of_what_was_read() -> None:
    shares = Shares(replicas_hint=4, clock=Clock())
    # Share 250, seeded with 400 / 4 = 100: 150 fit, 151 do not.
    refused, _ = await shares.reserve({DAY: 151}, {DAY: 400}, 1)
    assert isinstance(refused, Refused)
    assert refused.limit == DAY  # the configured limit, not the share
    assert refused.status.limit == 250
    assert refused.status.remaining == 150
    granted, local = await shares.reserve({DAY: 150}, {DAY: 400}, 1)
    assert isinstance(granted, Granted)
    assert local is not None
    assert granted.reservation.held[0][0] == DAY
    assert shares.used(DAY) == 250
    assert shares.unshared(DAY) == (START, 150)
    await shares.settle(local, {Measure.TOKENS: 40})
    assert shares.unshared(DAY) == (START, 40)


async def test_a_read_beyond_the_limit_leaves_no_share() -> None:
    shares = Shares(replicas_hint=2, clock=Clock())
    outcome, _ = await shares.reserve({DAY: 1}, {DAY: 5000}, 1)
    assert isinstance(outcome, Refused)
    assert shares.unshared(DAY)[1] == 0


async def test_a_new_outage_raises_the_seed_and_only_new_use_goes_up() -> None:
    shares = Shares(replicas_hint=2, clock=Clock())
    first, _ = await shares.reserve({DAY: 30}, {DAY: 100}, 1)
    assert isinstance(first, Granted)
    start, add = shares.unshared(DAY)
    assert add == 30
    shares.pushed(DAY, start, add)
    assert shares.unshared(DAY)[1] == 0
    # The same window, a later outage: the replica read 600 meanwhile (its 30 among them).
    second, _ = await shares.reserve({DAY: 5}, {DAY: 600}, 2)
    assert isinstance(second, Granted)
    assert shares.used(DAY) == 300 + 5
    assert shares.unshared(DAY)[1] == 5
    # Within one outage the seed is not raised again.
    third, _ = await shares.reserve({DAY: 5}, {DAY: 900}, 2)
    assert isinstance(third, Granted)
    assert shares.used(DAY) == 310


async def test_a_new_window_starts_afresh() -> None:
    clock = Clock()
    shares = Shares(replicas_hint=2, clock=clock)
    assert isinstance((await shares.reserve({DAY: 400}, {DAY: 200}, 1))[0], Granted)
    assert shares.used(DAY) == 500
    clock.now += 86400
    assert shares.used(DAY) == 0
    assert shares.unshared(DAY) == (START + 86400, 0)
    assert isinstance((await shares.reserve({DAY: 500}, {}, 1))[0], Granted)
