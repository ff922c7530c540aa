"""`engine.tenancy` as a table: who is asking, may they use the model, the worst case each
limit reserves, all or nothing, the settle, keep and release, the rate-limit headers and the
budget fallback; exact boundaries on an injected clock, no front involved."""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
from collections.abc import Mapping

import pytest

from switchyard_mw.config import parse_config
from switchyard_mw.core.limits import LimitKey, Measure, Status
from switchyard_mw.engine.tenancy import (
    BUDGET_ROUTE,
    DEFAULT_OUTPUT_TOKENS,
    Admission,
    Refusal,
    Tenancy,
    cost_usd,
    limit_label,
    openai_duration,
    rate_limit_headers,
    with_limits,
)
from switchyard_mw.engine.usage import Tokens
from switchyard_mw.state.limit_stores import LocalLimits
from switchyard_mw.wire import Wire

T0 = 1_800_000_000.0  # a whole minute: 2027-01-15T08:00:00Z


def sha(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


CONFIG = f"""
[llm_clients.a]
base_url = "https://a.example.test"
models = ["claude-opus-5", "claude-haiku-5", "gpt-5"]
[llm_clients.b]
base_url = "https://b.example.test"
models = ["gpt-5"]
default_max_tokens = 900
[tenants.team-a]
keys = ["{sha("sk-a")}"]
models = ["claude-*", "gpt-5*"]
limits = [
  {{ tokens = 1000, per = "minute" }},
  {{ tokens = 500, per = "minute", model = "claude-opus-5" }},
  {{ requests = 3, per = "minute" }},
]
[tenants.team-b]
keys_env = "TEAM_B_KEYS"
models = ["gpt-5"]
limits = [{{ usd = 1.0, per = "day" }}]
[server]
tenant_header = "x-switchyard-tenant"
[prices."claude-opus-5"]
input = 15.0
output = 75.0
cache_read = 1.5
cache_write = 18.75
[prices."gpt-5"]
input = 1.25
output = 10.0
[[limits]]
model = "claude-haiku-5"
tokens = 10000
per = "minute"
[fallbacks."claude-opus-5"]
models = ["claude-haiku-5"]
on = ["budget"]
"""


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def build(text: str = CONFIG) -> tuple[Tenancy, Clock]:
    clock = Clock()
    tenancy = Tenancy.build(
        parse_config(text),
        store=LocalLimits(clock=clock),
        environ={"TEAM_B_KEYS": "sk-b1, sk-b2"},
    )
    assert tenancy is not None
    return tenancy, clock


def headers(mapping: Mapping[str, str]):  # type: ignore[no-untyped-def]
    return lambda name: mapping.get(name)


def admit(tenancy: Tenancy, model: str, *, body: int, max_tokens: int | None, **kw: object):  # type: ignore[no-untyped-def]
    return asyncio.run(
        tenancy.admit(
            "team-a", model, wire=Wire.ANTHROPIC, body_bytes=body, max_tokens=max_tokens, **kw
        )  # type: ignore[arg-type]
    )


def test_without_tenants_there_is_no_tenancy() -> None:
    config = parse_config('[llm_clients.a]\nbase_url = "https://a.test"\nmodels = ["m"]\n')
    assert Tenancy.build(config, store=LocalLimits()) is None


@pytest.mark.parametrize(
    ("named", "sent", "expected"),
    [
        (None, {"x-api-key": "sk-a"}, "team-a"),
        (None, {"authorization": "Bearer sk-a"}, "team-a"),
        (None, {"authorization": "bearer  sk-b2 "}, "team-b"),
        (None, {"x-api-key": "sk-b1"}, "team-b"),
        # The trusted header beats the key; the app's own name beats both.
        (None, {"x-switchyard-tenant": "team-b", "x-api-key": "sk-a"}, "team-b"),
        ("team-a", {"x-switchyard-tenant": "team-b", "x-api-key": "sk-b1"}, "team-a"),
        (None, {"x-api-key": "sk-wrong"}, 401),
        (None, {}, 401),
        (None, {"authorization": "Basic c2stYQ=="}, 401),
        (None, {"x-switchyard-tenant": "team-z", "x-api-key": "sk-a"}, 401),
        ("team-z", {"x-api-key": "sk-a"}, 401),
    ],
)
def test_who_is_asking(named: str | None, sent: dict[str, str], expected: str | int) -> None:
    tenancy, _ = build()
    who = tenancy.identify(named=named, header=headers(sent))
    if isinstance(expected, str):
        assert who == expected
        return
    assert isinstance(who, Refusal)
    assert (who.error.status, who.error.error_type) == (401, "authentication_error")
    assert who.headers == ((b"x-should-retry", b"false"),)
    assert "sk-" not in who.error.message  # a key is never quoted back


def test_a_wrong_key_touches_no_counter() -> None:
    tenancy, _ = build()
    store = tenancy.store
    assert isinstance(store, LocalLimits)
    for i in range(1000):
        who = tenancy.identify(named=None, header=headers({"x-api-key": f"k{i}"}))
        assert isinstance(who, Refusal)
    assert store.ledger.counters() == 0


@pytest.mark.parametrize(
    ("tenant", "model", "allowed"),
    [
        ("team-a", "claude-opus-5", True),
        ("team-a", "gpt-5", True),
        ("team-a", "gpt-5-mini", True),
        ("team-a", "gemini-3", False),
        ("team-b", "gpt-5", True),
        ("team-b", "claude-opus-5", False),
    ],
)
def test_the_models_a_tenant_may_use(tenant: str, model: str, allowed: bool) -> None:
    tenancy, _ = build()
    refusal = tenancy.permit(tenant, model)
    if allowed:
        assert refusal is None
    else:
        assert refusal is not None
        assert (refusal.error.status, refusal.error.error_type) == (403, "permission_error")
        assert model in refusal.error.message


def test_the_limits_that_apply() -> None:
    tenancy, _ = build()
    labels = lambda model: sorted(limit_label(x) for x in tenancy.applying("team-a", model))  # noqa: E731
    assert labels("claude-opus-5") == [
        "requests/minute",
        "tokens/minute",
        "tokens/minute/claude-opus-5",
    ]
    assert labels("claude-haiku-5") == [
        "deployment:tokens/minute/claude-haiku-5",
        "requests/minute",
        "tokens/minute",
    ]
    assert labels("gpt-5") == ["requests/minute", "tokens/minute"]


def test_the_worst_case() -> None:
    tenancy, _ = build()
    # Input: ceil(bytes / 3); output: max_tokens, else the accounts' largest
    # default_max_tokens, else the documented default.
    assert tenancy.output_cap("gpt-5", 77) == 77
    assert tenancy.output_cap("gpt-5", None) == 900
    assert tenancy.output_cap("claude-opus-5", None) == DEFAULT_OUTPUT_TOKENS == 4096
    worst = tenancy.worst_case("claude-opus-5", 100, 200)
    assert worst[Measure.TOKENS] == 300
    assert worst[Measure.REQUESTS] == 1
    # USD at the dearest input price (a cache write, 18.75) and the output price.
    assert worst[Measure.USD] == pytest.approx((100 * 18.75 + 200 * 75.0) / 1e6)
    assert tenancy.worst_case("claude-haiku-5", 100, 200)[Measure.USD] == 0.0  # unpriced


def test_admission_reserves_on_every_limit_up_to_the_exact_boundary() -> None:
    tenancy, clock = build()
    # 300 bytes -> 100 tokens, + 400 = 500: exactly the opus limit.
    first = admit(tenancy, "claude-opus-5", body=300, max_tokens=400)
    assert isinstance(first, Admission)
    assert first.reserved[Measure.TOKENS] == 500
    statuses = {limit_label(k): s for k, s in first.statuses.items()}
    assert statuses["tokens/minute/claude-opus-5"] == Status(500, 0, 60)
    assert statuses["tokens/minute"] == Status(1000, 500, 60)
    assert statuses["requests/minute"] == Status(3, 2, 60)
    # One token more than is left: refused, and nothing of it reserved anywhere.
    clock.now += 15
    second = admit(tenancy, "claude-opus-5", body=3, max_tokens=0, pinned=True)
    assert isinstance(second, Refusal)
    assert (second.error.status, second.error.error_type) == (429, "rate_limit_error")
    assert second.limit is not None
    assert second.limit.model == "claude-opus-5"
    assert dict(second.headers)[b"retry-after"] == b"45"
    assert dict(second.headers)[b"anthropic-ratelimit-tokens-remaining"] == b"0"
    store = tenancy.store
    assert isinstance(store, LocalLimits)
    every = next(k for k in tenancy.applying("team-a", "gpt-5") if k.measure is Measure.TOKENS)
    assert store.used(every) == 500
    # A model without its own limit still fits the tenant's 1000.
    third = admit(tenancy, "gpt-5", body=30, max_tokens=490)
    assert isinstance(third, Admission)
    assert store.used(every) == 1000
    # The window rolls over on the minute: everything is free again.
    clock.now = T0 + 60
    assert isinstance(admit(tenancy, "claude-opus-5", body=300, max_tokens=400), Admission)


def test_a_request_no_wait_admits_is_told_not_to_retry() -> None:
    tenancy, _ = build()
    refused = admit(tenancy, "gpt-5", body=3, max_tokens=1000)  # 1001 > 1000
    assert isinstance(refused, Refusal)
    assert refused.error.status == 429
    assert b"retry-after" not in dict(refused.headers)
    assert dict(refused.headers)[b"x-should-retry"] == b"false"
    assert "no wait admits it" in refused.error.message


def test_requests_are_counted_one_each() -> None:
    tenancy, _ = build()
    for _ in range(3):
        assert isinstance(admit(tenancy, "gpt-5", body=3, max_tokens=1), Admission)
    refused = admit(tenancy, "gpt-5", body=3, max_tokens=1)
    assert isinstance(refused, Refusal)
    assert refused.limit is not None
    assert refused.limit.measure is Measure.REQUESTS


def test_settle_keep_and_release() -> None:
    tenancy, clock = build()
    store = tenancy.store
    assert isinstance(store, LocalLimits)
    every = next(k for k in tenancy.applying("team-a", "gpt-5") if k.measure is Measure.TOKENS)

    def charged(usage: Tokens | None, answered: bool) -> float:
        before = store.used(every)
        admitted = admit(tenancy, "gpt-5", body=300, max_tokens=200)
        assert isinstance(admitted, Admission)
        assert store.used(every) - before == 300  # the worst case, while it runs
        asyncio.run(tenancy.finish(admitted, usage=usage, answered=answered))
        after = store.used(every)
        # Finishing twice changes nothing.
        assert asyncio.run(tenancy.finish(admitted, usage=usage, answered=answered)) is None
        assert store.used(every) == after
        return after - before

    clock.now += 1  # each its own request in the one minute
    assert charged(Tokens(40, 7), answered=True) == 47  # the answer's usage
    # Usage known for the input only (a stream cut before its last event): output at its cap.
    assert charged(Tokens(40, None), answered=True) == 240
    assert charged(None, answered=True) == 300  # an answer started, no usage: kept whole


def test_a_request_that_billed_nothing_gives_its_reservation_back() -> None:
    tenancy, _ = build()
    store = tenancy.store
    assert isinstance(store, LocalLimits)
    every = next(k for k in tenancy.applying("team-a", "gpt-5") if k.measure is Measure.TOKENS)
    admitted = admit(tenancy, "gpt-5", body=300, max_tokens=200)
    assert isinstance(admitted, Admission)
    assert asyncio.run(tenancy.finish(admitted, usage=None, answered=False)) is None
    assert store.used(every) == 0


def test_usd_is_charged_at_the_cache_prices() -> None:
    tenancy, _ = build()
    price = tenancy.prices["claude-opus-5"]
    tokens = Tokens(input=1000, output=100, cache_read=600, cache_write=300)
    # 100 plain input at 15, 600 read at 1.5, 300 written at 18.75, 100 output at 75.
    assert cost_usd(price, tokens) == pytest.approx(
        (100 * 15 + 600 * 1.5 + 300 * 18.75 + 100 * 75) / 1e6
    )
    assert cost_usd(None, tokens) is None


def test_a_usd_limit_reserves_and_settles_dollars() -> None:
    tenancy, _ = build()

    async def run() -> tuple[Admission | Refusal, Admission | Refusal]:
        # 3 bytes -> 1 token; 99_000 output tokens at 10 USD/M = 0.99 USD (+ 1.25e-6).
        first = await tenancy.admit(
            "team-b", "gpt-5", wire=Wire.OPENAI_CHAT, body_bytes=3, max_tokens=99_000
        )
        assert isinstance(first, Admission)
        second = await tenancy.admit(
            "team-b", "gpt-5", wire=Wire.OPENAI_CHAT, body_bytes=3, max_tokens=1_000
        )
        assert isinstance(second, Refusal)
        await tenancy.finish(first, usage=Tokens(1, 10), answered=True)
        third = await tenancy.admit(
            "team-b", "gpt-5", wire=Wire.OPENAI_CHAT, body_bytes=3, max_tokens=1_000
        )
        return second, third

    second, third = asyncio.run(run())
    assert isinstance(second, Refusal)
    assert second.limit is not None
    assert second.limit.measure is Measure.USD
    assert isinstance(third, Admission)


def test_a_spent_model_limit_moves_down_a_budget_chain(caplog: pytest.LogCaptureFixture) -> None:
    tenancy, _ = build()
    assert isinstance(admit(tenancy, "claude-opus-5", body=3, max_tokens=499), Admission)
    moved = admit(tenancy, "claude-opus-5", body=3, max_tokens=100)
    assert isinstance(moved, Admission)
    assert (moved.model, moved.route) == ("claude-haiku-5", BUDGET_ROUTE)
    fell = [r for r in caplog.records if getattr(r, "event", None) == "fallback"]
    assert [(r.from_model, r.to_model, r.reason) for r in fell] == [  # type: ignore[attr-defined]
        ("claude-opus-5", "claude-haiku-5", "budget")
    ]
    # Reserved against the new model's limits: the deployment's for haiku counts it.
    assert {limit_label(k) for k in moved.statuses} >= {"deployment:tokens/minute/claude-haiku-5"}
    # Signed thinking binds the conversation to its model: the 429 instead.
    pinned = admit(tenancy, "claude-opus-5", body=3, max_tokens=100, pinned=True)
    assert isinstance(pinned, Refusal)
    assert pinned.error.status == 429


def test_a_spent_limit_of_every_model_does_not_move() -> None:
    tenancy, _ = build()
    assert isinstance(admit(tenancy, "gpt-5", body=3, max_tokens=999), Admission)
    refused = admit(tenancy, "claude-opus-5", body=3, max_tokens=100)
    assert isinstance(refused, Refusal)
    assert refused.limit is not None
    assert refused.limit.model is None


@pytest.mark.parametrize(
    ("secs", "text"),
    [
        (0.0, "0ms"),
        (0.0004, "1ms"),
        (0.25, "250ms"),
        (1.0, "1s"),
        (2.5, "2.5s"),
        (59.9991, "1m0s"),
        (360.0, "6m0s"),
        (3723.0, "1h2m3s"),
        (86400.0, "24h0m0s"),
    ],
)
def test_openai_reset_durations(secs: float, text: str) -> None:
    assert openai_duration(secs) == text


def test_the_tightest_limit_of_each_measure_in_each_wire_shape() -> None:
    def key(measure: Measure, amount: float, per: str = "minute") -> LimitKey:
        return LimitKey("t", measure, per, amount)  # type: ignore[arg-type]

    statuses = [
        (key(Measure.TOKENS, 1000), Status(1000, 400, 30)),
        (key(Measure.TOKENS, 100_000, "day"), Status(100_000, 90_000, 3600)),
        (key(Measure.REQUESTS, 10), Status(10, 9, 1.5)),
        (key(Measure.USD, 5), Status(5, 0.1, 60)),  # no provider header for dollars
    ]
    openai = dict(rate_limit_headers(Wire.OPENAI_RESPONSES, statuses))
    assert openai == {
        b"x-ratelimit-limit-requests": b"10",
        b"x-ratelimit-remaining-requests": b"9",
        b"x-ratelimit-reset-requests": b"1.5s",
        b"x-ratelimit-limit-tokens": b"1000",
        b"x-ratelimit-remaining-tokens": b"400",
        b"x-ratelimit-reset-tokens": b"30s",
    }
    anthropic = dict(rate_limit_headers(Wire.ANTHROPIC, statuses))
    assert set(anthropic) == {
        b"anthropic-ratelimit-requests-limit",
        b"anthropic-ratelimit-requests-remaining",
        b"anthropic-ratelimit-requests-reset",
        b"anthropic-ratelimit-tokens-limit",
        b"anthropic-ratelimit-tokens-remaining",
        b"anthropic-ratelimit-tokens-reset",
    }
    assert anthropic[b"anthropic-ratelimit-tokens-remaining"] == b"400"
    reset = dt.datetime.fromisoformat(anthropic[b"anthropic-ratelimit-tokens-reset"].decode())
    assert reset.tzinfo is not None
    left = (reset - dt.datetime.now(tz=dt.UTC)).total_seconds()
    assert 29 <= left <= 31


def test_the_tenants_headers_replace_the_accounts() -> None:
    upstream = [
        (b"content-type", b"application/json"),
        (b"x-ratelimit-remaining-tokens", b"999999"),
        (b"anthropic-ratelimit-tokens-limit", b"4000000"),
        (b"request-id", b"req_1"),
    ]
    ours = ((b"x-ratelimit-remaining-tokens", b"7"),)
    assert with_limits(upstream, ours) == [
        (b"content-type", b"application/json"),
        (b"request-id", b"req_1"),
        (b"x-ratelimit-remaining-tokens", b"7"),
    ]


def test_the_operator_view_shows_used_remaining_and_resets() -> None:
    tenancy, _ = build()
    admitted = admit(tenancy, "claude-opus-5", body=300, max_tokens=100)
    assert isinstance(admitted, Admission)
    shown = tenancy.status()
    assert set(shown) == {"team-a", "team-b", ""}
    opus = next(row for row in shown["team-a"] if row["model"] == "claude-opus-5")
    assert opus["tokens"] == 500
    assert opus["used"] == 200
    assert opus["remaining"] == 300
    assert opus["per"] == "minute"
    assert 0 < opus["resets_in_secs"] <= 60  # type: ignore[operator]
    assert shown["team-b"][0]["usd"] == 1.0


def test_a_refusal_is_one_decision_record(caplog: pytest.LogCaptureFixture) -> None:
    tenancy, _ = build()
    with caplog.at_level("WARNING", logger="switchyard_mw.limits"):
        for _ in range(4):
            admit(tenancy, "gpt-5", body=3, max_tokens=1)
    (record,) = caplog.records
    assert record.event == "limit.refused"  # type: ignore[attr-defined]
    assert record.tenant == "team-a"  # type: ignore[attr-defined]
    assert record.limit == "requests/minute"  # type: ignore[attr-defined]
    assert record.model == "gpt-5"  # type: ignore[attr-defined]
    assert record.retry_after_secs == 60  # type: ignore[attr-defined]
