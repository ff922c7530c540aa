"""Account affinity: weighted rendezvous hashing, alone and inside the pool's choice."""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from switchyard_mw.core import affinity
from switchyard_mw.core.pool import AccountPool, AccountSpec, Outcome

NAMES = ("a", "b", "c")
KEYS = [f"conversation-{i}" for i in range(30_000)]


def first_of(accounts: list[tuple[str, float]], keys: list[str] = KEYS) -> Counter[str]:
    return Counter(affinity.pick(k, accounts)[0] for k in keys)


@pytest.mark.parametrize(
    ("weights", "tolerance"),
    [
        ((1.0, 1.0, 1.0), 0.02),
        ((1.0, 2.0, 1.0), 0.02),
        ((3.0, 1.0, 1.0), 0.02),
        ((1.0, 1.0, 0.1), 0.02),
    ],
)
def test_each_account_takes_its_weights_share_of_keys(
    weights: tuple[float, ...], tolerance: float
) -> None:
    counts = first_of(list(zip(NAMES, weights, strict=True)))
    total = sum(weights)
    for name, w in zip(NAMES, weights, strict=True):
        assert counts[name] / len(KEYS) == pytest.approx(w / total, abs=tolerance)


def test_removing_an_account_moves_only_its_own_keys_each_to_its_next() -> None:
    full = [("a", 1.0), ("b", 2.0), ("c", 1.0), ("d", 1.0)]
    without_b = [x for x in full if x[0] != "b"]
    moved = 0
    for k in KEYS[:5000]:
        before, after = affinity.pick(k, full), affinity.pick(k, without_b)
        if before[0] == "b":
            moved += 1
            assert after[0] == before[1]  # its own next account
        else:
            assert after[0] == before[0]  # everyone else stays
        assert after == [n for n in before if n != "b"]  # the order itself is kept
    assert moved / 5000 == pytest.approx(2 / 5, abs=0.03)


def test_the_order_is_a_pure_function_of_key_names_and_weights() -> None:
    accounts = [("east", 1.0), ("west", 1.0), ("north", 2.0)]
    assert sorted(affinity.pick("k", accounts)) == ["east", "north", "west"]
    # Config order does not matter: the same key ranks the same accounts the same way.
    assert affinity.pick("k", accounts) == affinity.pick("k", accounts[::-1])
    assert affinity.key_hash("k") == affinity.key_hash("k") != affinity.key_hash("k2")


@settings(max_examples=200, deadline=None)
@given(
    key=st.text(min_size=1, max_size=40),
    weights=st.lists(st.floats(min_value=0.01, max_value=100.0), min_size=2, max_size=6),
    gone=st.integers(min_value=0, max_value=5),
)
def test_property_removing_one_account_keeps_the_others_relative_order(
    key: str, weights: list[float], gone: int
) -> None:
    accounts = [(f"acct-{i}", w) for i, w in enumerate(weights)]
    gone %= len(accounts)
    before = affinity.pick(key, accounts)
    after = affinity.pick(key, accounts[:gone] + accounts[gone + 1 :])
    assert after == [n for n in before if n != accounts[gone][0]]


@settings(max_examples=200, deadline=None)
@given(key=st.integers(min_value=0, max_value=(1 << 64) - 1), w=st.floats(0.001, 1e6))
def test_property_scores_are_finite_and_positive(key: int, w: float) -> None:
    s = affinity.score(key, affinity.seed("x"), w)
    assert 0 < s < float("inf")


# --- inside the pool ------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def pool(clock: Clock, *, weights: tuple[float, ...] = (1.0, 1.0, 1.0)) -> AccountPool:
    return AccountPool(
        [
            AccountSpec(name=n, models=frozenset({"m"}), weight=w, failure_threshold=1)
            for n, w in zip(NAMES, weights, strict=True)
        ]
        + [AccountSpec(name="backup", models=frozenset({"m"}), priority=1)],
        clock=clock,
    )


def test_a_keyed_request_goes_to_its_rendezvous_account_every_time() -> None:
    p = pool(Clock())
    for k in KEYS[:300]:
        key = affinity.key_hash(k)
        want = affinity.pick(k, [(n, 1.0) for n in NAMES])[0]
        for _ in range(3):
            lease = p.acquire("m", key=key)
            assert lease is not None
            assert lease.account == want
            p.record(lease, Outcome.SUCCESS)


def test_a_cooled_account_moves_only_its_conversations_and_they_come_back() -> None:
    clock = Clock()
    p = pool(clock)
    keys = {k: affinity.key_hash(k) for k in KEYS[:900]}
    home = {k: p.acquire("m", key=h).account for k, h in keys.items()}  # type: ignore[union-attr]
    lease = p.acquire("m", key=next(h for k, h in keys.items() if home[k] == "b"))
    assert lease is not None
    assert lease.account == "b"
    p.record(lease, Outcome.FAULT)  # threshold 1: b cools for 30 s
    during = {k: p.acquire("m", key=h).account for k, h in keys.items()}  # type: ignore[union-attr]
    moved = {k for k in keys if during[k] != home[k]}
    assert moved == {k for k in keys if home[k] == "b"}
    for k in moved:
        assert during[k] == affinity.pick(k, [(n, 1.0) for n in NAMES])[1]
    clock.now += 31  # b is due a probe: the first of its conversations probes it
    probe = p.acquire("m", key=keys[next(iter(moved))])
    assert probe is not None
    assert probe.probe
    assert probe.account == "b"
    p.record(probe, Outcome.SUCCESS)
    after = {k: p.acquire("m", key=h).account for k, h in keys.items()}  # type: ignore[union-attr]
    assert after == home


def test_tried_and_held_accounts_give_way_to_the_next_in_order() -> None:
    p = pool(Clock())
    k = KEYS[7]
    order = affinity.pick(k, [(n, 1.0) for n in NAMES])
    key = affinity.key_hash(k)
    assert p.acquire("m", key=key, exclude=[order[0]]).account == order[1]  # type: ignore[union-attr]
    p.hold(order[0], "m", 10)
    assert p.acquire("m", key=key).account == order[1]  # type: ignore[union-attr]
    got = p.acquire("m", key=key, exclude=order)
    assert got is not None
    assert got.account == "backup"


def test_requests_without_a_key_keep_the_rotation() -> None:
    p = pool(Clock())
    got = [p.acquire("m").account for _ in range(6)]  # type: ignore[union-attr]
    assert got == ["a", "b", "c", "a", "b", "c"]


def test_a_removed_account_moves_only_its_conversations() -> None:
    clock = Clock()
    p = pool(clock)
    smaller = AccountPool(
        [AccountSpec(name=n, models=frozenset({"m"})) for n in ("a", "c")], clock=clock
    )
    smaller.carry_over(p)
    for k in KEYS[:600]:
        key = affinity.key_hash(k)
        before = p.acquire("m", key=key).account  # type: ignore[union-attr]
        after = smaller.acquire("m", key=key).account  # type: ignore[union-attr]
        assert after == before or before == "b"


def test_weights_set_each_accounts_share_through_the_pool() -> None:
    p = pool(Clock(), weights=(1.0, 2.0, 1.0))
    counts = Counter(p.acquire("m", key=affinity.key_hash(k)).account for k in KEYS[:20_000])  # type: ignore[union-attr]
    assert counts["b"] / 20_000 == pytest.approx(0.5, abs=0.02)
    assert counts["a"] / 20_000 == pytest.approx(0.25, abs=0.02)


@pytest.mark.parametrize("weight", [0.0, -1.0, float("inf"), float("nan")])
def test_a_weight_must_be_positive_and_finite(weight: float) -> None:
    with pytest.raises(ValueError, match="weight"):
        AccountSpec(name="a", models=frozenset({"m"}), weight=weight)
