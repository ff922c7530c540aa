"""Throttle hold: reading a 429's retry time, and the pool keeping a held account out."""

from __future__ import annotations

import pytest
from test_cooling import BODY, MESSAGES, FakeClock, Upstream, account, http, stack

from conftest import Metrics
from switchyard_mw.core.pool import MAX_HOLDS, AccountPool, AccountSpec, Outcome
from switchyard_mw.core.throttle import retry_secs
from switchyard_mw.telemetry import names as tm

NOW = 1_800_000_000.0  # 2027-01-15T08:00:00Z
NOW_HTTP = "Fri, 15 Jan 2027 08:00:00 GMT"


def h(**headers: str) -> list[tuple[str, str]]:
    return [(k.replace("_", "-"), v) for k, v in headers.items()]


def test_the_http_date_constants_agree() -> None:
    assert retry_secs(h(retry_after=NOW_HTTP), wall_now=NOW) == 0.0


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        (h(retry_after="20"), 20.0),
        (h(retry_after="1.5"), 1.5),
        (h(retry_after="0"), 0.0),
        (h(retry_after="Fri, 15 Jan 2027 08:00:30 GMT"), 30.0),
        (h(retry_after="Fri, 15 Jan 2027 07:59:00 GMT"), 0.0),  # already past: never negative
        (h(retry_after_ms="2500"), 2.5),
        (h(retry_after_ms="2500", retry_after="3"), 2.5),  # the finer one wins
        (h(retry_after="soon"), None),
        (h(retry_after="-5"), None),
        (h(retry_after="nan"), None),
        (h(retry_after="inf"), None),
        (h(retry_after="9" * 100), None),
        ([], None),
        (h(content_type="application/json"), None),
    ],
)
def test_retry_after_forms(headers: list[tuple[str, str]], expected: float | None) -> None:
    assert retry_secs(headers, wall_now=NOW) == expected


def test_an_exhausted_anthropic_limit_that_resets_later_wins() -> None:
    headers = h(
        retry_after="5",
        anthropic_ratelimit_tokens_remaining="0",
        anthropic_ratelimit_tokens_reset="2027-01-15T08:00:40Z",
    )
    assert retry_secs(headers, wall_now=NOW) == 40.0


def test_a_limit_that_is_not_exhausted_says_nothing() -> None:
    headers = h(
        retry_after="5",
        anthropic_ratelimit_requests_remaining="10",
        anthropic_ratelimit_requests_reset="2027-01-15T08:05:00Z",
    )
    assert retry_secs(headers, wall_now=NOW) == 5.0


def test_an_exhausted_reset_alone_is_a_retry_time() -> None:
    headers = h(
        anthropic_ratelimit_output_tokens_remaining="0",
        anthropic_ratelimit_output_tokens_reset="2027-01-15T08:00:12+00:00",
    )
    assert retry_secs(headers, wall_now=NOW) == 12.0


@pytest.mark.parametrize(
    ("reset", "expected"),
    [("1s", 1.0), ("6m0s", 360.0), ("250ms", 0.25), ("1h2m3.5s", 3723.5), ("17", 17.0)],
)
def test_openai_reset_durations(reset: str, expected: float) -> None:
    headers = h(x_ratelimit_remaining_requests="0", x_ratelimit_reset_requests=reset)
    assert retry_secs(headers, wall_now=NOW) == pytest.approx(expected)


def test_a_garbled_reset_is_ignored() -> None:
    headers = h(
        retry_after="3",
        x_ratelimit_remaining_tokens="0",
        x_ratelimit_reset_tokens="whenever",
        anthropic_ratelimit_tokens_remaining="0",
        anthropic_ratelimit_tokens_reset="2027-13-45T99:00:00Z",
    )
    assert retry_secs(headers, wall_now=NOW) == 3.0


# -- the pool's holds --------------------------------------------------------------------------


def pool(clock: FakeClock, **overrides: float) -> AccountPool:
    specs = [
        AccountSpec(name="a", models=frozenset({"m", "n"}), **overrides),  # type: ignore[arg-type]
        AccountSpec(name="b", models=frozenset({"m"}), priority=1),
    ]
    return AccountPool(specs, clock=clock)


def test_a_held_account_is_skipped_for_that_model_until_the_hold_ends() -> None:
    clock = FakeClock()
    p = pool(clock)
    assert p.hold("a", "m", 20.0) == 20.0
    lease = p.acquire("m")
    assert lease is not None
    assert lease.account == "b"
    clock.now += 19.999
    lease = p.acquire("m")
    assert lease is not None
    assert lease.account == "b"
    clock.now += 0.001
    lease = p.acquire("m")
    assert lease is not None
    assert lease.account == "a"


def test_a_hold_of_one_model_leaves_the_account_serving_another() -> None:
    clock = FakeClock()
    p = pool(clock)
    p.hold("a", "m", 20.0)
    lease = p.acquire("n")
    assert lease is not None
    assert lease.account == "a"


def test_a_hold_is_capped_by_max_throttle_secs() -> None:
    clock = FakeClock()
    p = pool(clock, max_throttle_secs=5.0)
    assert p.hold("a", "m", 3600.0) == 5.0
    clock.now += 5.0
    lease = p.acquire("m", exclude=["b"])
    assert lease is not None
    assert lease.account == "a"


def test_a_hold_never_shortens_a_longer_one() -> None:
    clock = FakeClock()
    p = pool(clock)
    p.hold("a", "m", 30.0)
    p.hold("a", "m", 2.0)
    clock.now += 10
    assert p.acquire("m", exclude=["b"]) is None


def test_a_hold_is_not_a_fault_and_success_elsewhere_does_not_clear_it() -> None:
    clock = FakeClock()
    p = pool(clock, failure_threshold=1)
    for _ in range(5):
        p.hold("a", "m", 10.0)
    status = p.status_of("a")
    assert status.consecutive_faults == 0
    assert status.cooled_until is None
    lease = p.acquire("n")
    assert lease is not None
    p.record(lease, Outcome.SUCCESS)
    assert p.acquire("m", exclude=["b"]) is None


def test_all_held_then_retry_after_is_the_earliest_hold_end_and_throttled_says_so() -> None:
    clock = FakeClock()
    p = pool(clock)
    p.hold("a", "m", 12.0)
    p.hold("b", "m", 7.5)
    assert p.acquire("m") is None
    assert p.throttled("m")
    assert p.retry_after_secs("m") == 7.5
    assert not p.throttled("n")


def test_cooled_alone_is_not_throttled() -> None:
    clock = FakeClock()
    p = pool(clock, failure_threshold=1)
    lease = p.acquire("n")
    assert lease is not None
    p.record(lease, Outcome.FAULT)
    assert p.acquire("n") is None
    assert not p.throttled("n")


def test_holds_of_many_models_stay_bounded() -> None:
    clock = FakeClock()
    wildcard = AccountPool([AccountSpec(name="w", models=frozenset({"*"}))], clock=clock)
    for i in range(20_000):
        wildcard.hold("w", f"model-{i}", 60.0)
        clock.now += 0.001
    assert wildcard.hold_count() == MAX_HOLDS
    clock.now += 60.0  # every hold is over: the next one makes room
    assert wildcard.hold("w", "again", 1.0) == 1.0
    assert wildcard.hold_count() == 1


def test_holds_show_in_the_status_with_model_and_end() -> None:
    clock = FakeClock()
    p = pool(clock)
    p.hold("a", "m", 20.0)
    assert p.holds_of("a") == {"m": 1020.0}
    clock.now += 21
    assert p.holds_of("a") == {}


# -- through the cooling middleware (in process, scripted upstream, injected clock) ------------


@pytest.mark.parametrize(
    "retry",
    [
        {"retry-after": "20"},
        {"retry-after-ms": "20000"},
        {"retry-after": "Fri, 15 Jan 2100 08:00:00 GMT"},  # far off: capped at 60 s
        {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "20s"},
    ],
)
async def test_the_next_request_skips_the_held_account_until_the_hold_ends(
    retry: dict[str, str], otel_metrics: Metrics
) -> None:
    clock = FakeClock()
    upstream = Upstream({"a": (429, retry)})
    app, pool = stack(upstream, account("a"), account("b", priority=1), clock=clock)
    held_before = otel_metrics.value(
        "switchyard.account.throttled", **{tm.ACCOUNT: "a", tm.RESPONSE_MODEL: "m"}
    )
    async with http(app) as client:
        first = await client.post(MESSAGES, json=BODY)
        assert (first.status_code, first.headers["x-switchyard-attempts"]) == (200, "2")
        second = await client.post(MESSAGES, json=BODY)
        assert second.headers["x-switchyard-attempts"] == "1"
        assert second.headers["x-switchyard-account"] == "b"
        assert upstream.calls("a") == 1
        clock.now += 60.0  # every form above ends by then (the date by the 60 s cap)
        upstream.script = {}
        third = await client.post(MESSAGES, json=BODY)
        assert third.headers["x-switchyard-account"] == "a"
    assert otel_metrics.value(
        "switchyard.account.throttled", **{tm.ACCOUNT: "a", tm.RESPONSE_MODEL: "m"}
    ) == (held_before + 1)
    status = pool.status_of("a")
    assert status.consecutive_faults == 0
    assert status.cooled_until is None


async def test_a_429_without_a_retry_time_holds_nothing() -> None:
    clock = FakeClock()
    upstream = Upstream({"a": 429})
    app, pool = stack(upstream, account("a"), account("b", priority=1), clock=clock)
    async with http(app) as client:
        await client.post(MESSAGES, json=BODY)
        upstream.script = {}
        second = await client.post(MESSAGES, json=BODY)
    assert second.headers["x-switchyard-account"] == "a"
    assert pool.holds_of("a") == {}


async def test_every_account_held_is_a_local_429_with_the_earliest_hold_end() -> None:
    clock = FakeClock()
    upstream = Upstream({"a": (429, {"retry-after": "12"}), "b": (429, {"retry-after": "7"})})
    app, _ = stack(upstream, account("a"), account("b", priority=1), clock=clock)
    async with http(app) as client:
        first = await client.post(MESSAGES, json=BODY)
        assert first.status_code == 429  # b's own answer, passed on
        calls = len(upstream.seen)
        clock.now += 2.0
        local = await client.post(MESSAGES, json=BODY)
        openai = await client.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        )
    assert len(upstream.seen) == calls  # no upstream was called
    assert local.status_code == 429
    assert local.headers["retry-after"] == "5"
    assert local.json()["error"]["type"] == "rate_limited"
    assert local.json()["type"] == "error"
    assert openai.status_code == 429
    assert openai.json()["error"]["code"] == "rate_limited"


async def test_held_and_cooled_together_answer_429_not_503() -> None:
    clock = FakeClock()
    upstream = Upstream({"a": (429, {"retry-after": "30"}), "b": 500})
    app, _ = stack(upstream, account("a"), account("b", priority=1), clock=clock)
    async with http(app) as client:
        await client.post(MESSAGES, json=BODY)  # a held, b faulted and cooled (threshold 1)
        response = await client.post(MESSAGES, json=BODY)
    assert response.status_code == 429
    assert response.json()["error"]["type"] == "rate_limited"
    assert int(response.headers["retry-after"]) <= 30
