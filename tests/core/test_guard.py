"""The canary guard: a variant that faults more than its threshold and its base rolls back."""

from __future__ import annotations

import pytest

from switchyard_mw.core.guard import GuardRule, Window
from switchyard_mw.core.variant_buckets import Split
from switchyard_mw.engine.variants import Canaries


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_window_counts_only_the_last_window_secs() -> None:
    clock = FakeClock()
    window = Window(window_secs=60, clock=clock)
    for _ in range(10):
        window.add(fault=True)
    clock.now += 30
    for _ in range(5):
        window.add(fault=False)
    assert window.counts() == (15, 10)
    clock.now += 31  # the first ten are more than 60 s old (to a tenth of the window)
    assert window.counts() == (5, 0)
    clock.now += 60
    assert window.counts() == (0, 0)


def test_a_window_idle_for_a_long_time_is_empty_and_cheap() -> None:
    clock = FakeClock()
    window = Window(window_secs=10, clock=clock)
    window.add(fault=True)
    clock.now += 1e9
    assert window.counts() == (0, 0)
    window.add(fault=False)
    assert window.counts() == (1, 0)


RULE = GuardRule(max_fault_rate=0.05, min_requests=50, window_secs=300)


def canaries(clock: FakeClock, *, percent: float = 50.0) -> Canaries:
    return Canaries(
        {"base": Split.build("base", [("var", percent)], "s")},
        guards={"base": RULE},
        clock=clock,
    )


def keys_on(c: Canaries, model: str, n: int = 400) -> list[str]:
    return [k for k in (f"user-{i}" for i in range(n)) if c.choose("base", k, None)[0] == model]


def test_a_failing_variant_trips_after_min_requests_and_its_share_drops_to_zero() -> None:
    clock = FakeClock()
    c = canaries(clock)
    on_variant = keys_on(c, "var")
    assert on_variant
    for _ in range(49):
        c.record("var", fault=True)
        c.record("base", fault=False)
    assert not c.tripped("base", "var")  # 49 attempts: below min_requests
    c.record("var", fault=True)
    assert c.tripped("base", "var")
    assert keys_on(c, "var") == []
    # ... exactly as a rollback to 0 would: every key is back on the base model.
    assert all(c.choose("base", k, None)[0] == "base" for k in on_variant)


def test_a_pinned_conversation_keeps_its_variant_after_a_trip() -> None:
    clock = FakeClock()
    c = canaries(clock)
    key = keys_on(c, "var")[0]
    for _ in range(60):
        c.record("var", fault=True)
    assert c.tripped("base", "var")
    assert c.choose("base", key, None, pinned=True)[0] == "var"
    assert c.choose("base", key, None)[0] == "base"


def test_a_variant_no_worse_than_its_base_never_trips() -> None:
    clock = FakeClock()
    c = canaries(clock)
    for i in range(2000):
        c.record("base", fault=i % 8 == 0)  # the base fails 12.5% ...
        c.record("var", fault=i % 10 == 0)  # ... the variant 10%: over the threshold, not worse
        clock.now += 0.1
    assert not c.tripped("base", "var")


def test_a_variant_under_the_threshold_never_trips_even_if_worse_than_base() -> None:
    clock = FakeClock()
    c = canaries(clock)
    for i in range(1000):
        c.record("var", fault=i % 50 == 0)  # 2%
        c.record("base", fault=False)
    assert not c.tripped("base", "var")


def test_old_faults_leave_the_window() -> None:
    clock = FakeClock()
    c = canaries(clock)
    for _ in range(40):
        c.record("var", fault=True)
    clock.now += 301
    for _ in range(40):
        c.record("var", fault=False)
    c.record("var", fault=True)
    assert not c.tripped("base", "var")  # 1 fault in 41 within the window: 2.4%


def test_a_trip_is_sticky_and_reported_once() -> None:
    clock = FakeClock()
    c = canaries(clock)
    trips: list[tuple[str, str]] = []
    c.on_trip = lambda model, variant: trips.append((model, variant))
    for _ in range(200):
        c.record("var", fault=True)
    clock.now += 10_000
    for _ in range(200):
        c.record("var", fault=False)
    assert c.tripped("base", "var")
    assert trips == [("base", "var")]


def test_a_canary_without_a_guard_never_trips() -> None:
    clock = FakeClock()
    c = Canaries({"base": Split.build("base", [("var", 50.0)], "s")}, guards={}, clock=clock)
    for _ in range(500):
        c.record("var", fault=True)
    assert not c.tripped("base", "var")
    assert keys_on(c, "var")


def test_trip_applies_a_trip_from_elsewhere() -> None:
    clock = FakeClock()
    c = canaries(clock)
    c.trip("base", "var")
    assert keys_on(c, "var") == []
    c.trip("base", "unknown")  # another replica's newer config: ignored
    c.trip("nope", "var")


def test_status_shows_split_counts_and_state() -> None:
    clock = FakeClock()
    c = canaries(clock, percent=10.0)
    c.record("var", fault=True)
    c.record("base", fault=False)
    (status,) = c.status()
    assert status == {
        "model": "base",
        "variants": {"var": 10.0},
        "guard": {"max_fault_rate": 0.05, "min_requests": 50, "window_secs": 300.0},
        "window": {"base": {"attempts": 1, "faults": 0}, "var": {"attempts": 1, "faults": 1}},
        "tripped": [],
    }


@pytest.mark.parametrize("bad", [-0.1, 1.5])
def test_rule_bounds(bad: float) -> None:
    with pytest.raises(ValueError, match="max_fault_rate"):
        GuardRule(max_fault_rate=bad, min_requests=1, window_secs=1)


# -- through the stack, in process -----------------------------------------------------------


async def test_through_the_stack_a_variant_as_healthy_as_its_base_never_trips() -> None:
    import itertools

    import httpx
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from switchyard_mw.asgi.stack import switchyard_stack
    from switchyard_mw.config import parse_config
    from switchyard_mw.context import current_context

    counts: dict[str, itertools.count[int]] = {}

    async def upstream(request: Request) -> JSONResponse:
        ctx = current_context()
        assert ctx is not None
        model = ctx.resolved_model or ""
        n = next(counts.setdefault(model, itertools.count()))
        return JSONResponse({}, status_code=500 if n % 50 == 49 else 200)  # 2% each

    config = parse_config(
        "[llm_clients.a]\nbase_url = 'http://a'\nmodels = ['b', 'v']\nfailure_threshold = 1000\n"
        "[canaries.b]\nvariants = { v = 50.0 }\n"
        "guard = { max_fault_rate = 0.05, min_requests = 20, window_secs = 600 }\n"
    )
    app = Starlette(routes=[Route("/v1/messages", upstream, methods=["POST"])])
    stack = switchyard_stack(app, config=config, environ={})
    transport = httpx.ASGITransport(app=stack)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        for i in range(400):
            body = {
                "model": "b",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "x"}],
                "metadata": {"user_id": f"u{i}"},
            }
            await client.post("/v1/messages", json=body)
    (status,) = stack.variant.canaries.status()
    assert status["tripped"] == []
    assert status["window"]["v"]["attempts"] >= 150  # both arms really ran
    assert status["window"]["b"]["attempts"] >= 150
    assert status["window"]["v"]["faults"] >= 3
