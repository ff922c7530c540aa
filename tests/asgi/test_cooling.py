"""CoolingMiddleware in process: an ASGI "upstream app" scripted per account, a fake pool clock."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conftest import Metrics
from switchyard_mw.accounts import Account, pool_from_accounts
from switchyard_mw.asgi._types import ASGIApp, Message, Receive, Scope, Send
from switchyard_mw.asgi.cooling import (
    MAX_HELD_BYTES,
    CoolingMiddleware,
    cooling_status_app,
)
from switchyard_mw.asgi.deadline import DeadlineMiddleware
from switchyard_mw.asgi.variant import VariantMiddleware
from switchyard_mw.config import Canary, LLMClient
from switchyard_mw.context import current_context
from switchyard_mw.core.pool import AccountPool, BreakerState, Outcome
from switchyard_mw.telemetry import names as tm

MESSAGES = "/v1/messages"
BODY: dict[str, Any] = {
    "model": "m",
    "max_tokens": 16,
    "messages": [{"role": "user", "content": "hi"}],
}
THINKING_BODY: dict[str, Any] = {
    **BODY,
    "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "s"}]},
        {"role": "user", "content": "more"},
    ],
}
Behaviour = int | Exception | tuple[int, dict[str, str]]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def account(
    name: str, *, models: tuple[str, ...] = ("m",), priority: int = 0, **spec: Any
) -> Account:
    spec.setdefault("failure_threshold", 1)
    llm = LLMClient(base_url=f"http://{name}.test", models=list(models), priority=priority, **spec)
    return Account(name=name, spec=llm, api_key=f"sk-secret-{name}")


def client_name() -> str:
    ctx = current_context()
    return ctx.account.name if ctx is not None and ctx.account is not None else "-"


class Upstream:
    """Stands in for the gateway app: answers per `ctx.account.name` as scripted, records bodies."""

    def __init__(
        self, script: dict[str, Behaviour] | None = None, *, delay: dict[str, float] | None = None
    ) -> None:
        self.script = script or {}
        self.delay = delay or {}
        self.seen: list[tuple[str, bytes]] = []
        self.report: dict[str, int] = {}

    def calls(self, name: str) -> int:
        return sum(1 for who, _ in self.seen if who == name)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ctx = current_context()
        name = client_name()
        message = await receive()
        self.seen.append((name, message.get("body", b"")))
        await asyncio.sleep(self.delay.get(name, 0))
        behaviour = self.script.get(name, 200)
        if isinstance(behaviour, Exception):
            raise type(behaviour)(*behaviour.args)
        status, extra = behaviour if isinstance(behaviour, tuple) else (behaviour, {})
        if name in self.report and ctx is not None:
            ctx.report_upstream(self.report[name])
        body = json.dumps({"account": name}).encode()
        headers = [
            (b"content-type", b"application/json"),
            *((k.encode(), v.encode()) for k, v in extra.items()),
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def stack(
    app: ASGIApp, *accounts: Account, clock: FakeClock, canary: bool = False
) -> tuple[ASGIApp, AccountPool]:
    cooling = CoolingMiddleware(app, accounts={a.name: a for a in accounts}, clock=clock)
    outer: ASGIApp = cooling
    if canary:  # every conversation for "m" goes to the variant "m-v"
        outer = VariantMiddleware(cooling, canaries={"m": Canary(variants={"m-v": 100.0})})
    return outer, cooling.pool


def http(app: ASGIApp) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw.test")


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def spans(otel_spans: InMemorySpanExporter) -> InMemorySpanExporter:
    return otel_spans


def cool(pool: AccountPool, name: str) -> None:
    """One fault on `name` (threshold 1 in these tests): it cools."""
    lease = pool.acquire("m", allowed=[name])
    assert lease is not None
    pool.record(lease, Outcome.FAULT)


# --- statuses ----------------------------------------------------------------------------


@pytest.mark.parametrize("status", [401, 402, 403, 500, 502, 503, 504])
async def test_fault_fails_over_counts_and_cools(
    status: int, clock: FakeClock, otel_metrics: Metrics
) -> None:
    upstream = Upstream({"a": status})
    app, pool = stack(upstream, account("a"), account("b", priority=1), clock=clock)
    faults = otel_metrics.value(tm.ACCOUNT_FAULTS, **{tm.ACCOUNT: "a"}, status=str(status))
    cooled = otel_metrics.value(tm.ACCOUNT_COOLED, **{tm.ACCOUNT: "a"})
    failovers = otel_metrics.value(tm.FAILOVERS, **{tm.RESPONSE_MODEL: "m"})
    async with http(app) as client:
        first = await client.post(MESSAGES, json=BODY)
        second = await client.post(MESSAGES, json=BODY)
    assert first.status_code == 200
    assert first.json() == {"account": "b"}
    assert first.headers["x-switchyard-account"] == "b"
    assert first.headers["x-switchyard-attempts"] == "2"
    assert second.headers["x-switchyard-attempts"] == "1"  # "a" is cooling: straight to "b"
    assert [who for who, _ in upstream.seen] == ["a", "b", "b"]
    assert pool.status_of("a").state is BreakerState.COOLED
    assert (
        otel_metrics.value(tm.ACCOUNT_FAULTS, **{tm.ACCOUNT: "a"}, status=str(status)) == faults + 1
    )
    assert otel_metrics.value(tm.ACCOUNT_COOLED, **{tm.ACCOUNT: "a"}) == cooled + 1
    assert otel_metrics.value(tm.FAILOVERS, **{tm.RESPONSE_MODEL: "m"}) == failovers + 1


async def test_throttle_fails_over_but_never_counts(
    clock: FakeClock, otel_metrics: Metrics
) -> None:
    upstream = Upstream({"a": 429})
    app, pool = stack(upstream, account("a"), account("b", priority=1), clock=clock)
    faults = otel_metrics.value(tm.ACCOUNT_FAULTS, **{tm.ACCOUNT: "a"})
    failovers = otel_metrics.value(tm.FAILOVERS, **{tm.RESPONSE_MODEL: "m"})
    async with http(app) as client:
        first = await client.post(MESSAGES, json=BODY)
        second = await client.post(MESSAGES, json=BODY)
    assert (first.status_code, first.headers["x-switchyard-attempts"]) == (200, "2")
    assert second.headers["x-switchyard-attempts"] == "2"  # "a" is tried again first
    status = pool.status_of("a")
    assert (status.state, status.consecutive_faults) == (BreakerState.CLOSED, 0)
    assert otel_metrics.value(tm.ACCOUNT_FAULTS, **{tm.ACCOUNT: "a"}) == faults
    assert otel_metrics.value(tm.FAILOVERS, **{tm.RESPONSE_MODEL: "m"}) == failovers + 2


@pytest.mark.parametrize("status", [400, 404, 422])
async def test_request_errors_reach_the_client_without_failover(
    status: int, clock: FakeClock
) -> None:
    upstream = Upstream({"a": status})
    app, pool = stack(upstream, account("a"), account("b", priority=1), clock=clock)
    async with http(app) as client:
        response = await client.post(MESSAGES, json=BODY)
    assert response.status_code == status
    assert response.headers["x-switchyard-attempts"] == "1"
    assert upstream.calls("b") == 0
    assert pool.status_of("a").state is BreakerState.CLOSED


async def test_the_only_accounts_429_reaches_the_client(clock: FakeClock) -> None:
    upstream = Upstream({"a": (429, {"retry-after": "7"})})
    app, _ = stack(upstream, account("a"), clock=clock)
    async with http(app) as client:
        response = await client.post(MESSAGES, json=BODY)
    assert response.status_code == 429
    assert response.headers.get("retry-after") == "7"
    assert response.json() == {"account": "a"}


@pytest.mark.parametrize("status", [401, 402, 403])
async def test_the_only_accounts_key_refusal_never_reaches_the_client(
    status: int, clock: FakeClock
) -> None:
    """A provider refusing its own key is not the client's 401: the first request already
    gets the 503 that says the credentials were refused, and invites no retry."""
    upstream = Upstream({"a": status})
    app, _ = stack(upstream, account("a"), clock=clock)
    async with http(app) as client:
        response = await client.post(MESSAGES, json=BODY)
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "no_healthy_account"
    assert "refused the credentials" in response.json()["error"]["message"]
    assert response.headers["x-should-retry"] == "false"
    assert "retry-after" not in response.headers
    assert response.headers["x-switchyard-attempts"] == "1"


async def test_last_held_answer_wins_when_every_account_fails(clock: FakeClock) -> None:
    upstream = Upstream({"a": (429, {"retry-after": "3"}), "b": httpx.ConnectError("refused")})
    app, _ = stack(upstream, account("a"), account("b", priority=1), clock=clock)
    async with http(app) as client:
        response = await client.post(MESSAGES, json=BODY)
    assert response.status_code == 429  # the 429 nobody could absorb, not a made-up error
    assert response.headers["retry-after"] == "3"
    assert response.headers["x-switchyard-account"] == "a"
    assert response.headers["x-switchyard-attempts"] == "2"


async def test_reported_upstream_status_decides(clock: FakeClock, otel_metrics: Metrics) -> None:
    upstream = Upstream({"a": 502, "c": 500})
    upstream.report = {"a": 429, "c": 400}  # the app rewrote the status it answers with
    app, pool = stack(upstream, account("a"), account("b", priority=1), clock=clock)
    async with http(app) as client:
        response = await client.post(MESSAGES, json=BODY)
    assert (response.status_code, response.headers["x-switchyard-attempts"]) == (200, "2")
    assert pool.status_of("a").consecutive_faults == 0  # a throttle, as reported

    upstream2 = Upstream({"c": 500})
    upstream2.report = {"c": 400}
    app2, pool2 = stack(upstream2, account("c"), account("d", priority=1), clock=clock)
    async with http(app2) as client:
        response = await client.post(MESSAGES, json=BODY)
    assert (response.status_code, upstream2.calls("d")) == (500, 0)
    assert pool2.status_of("c").consecutive_faults == 0


# --- failover mechanics --------------------------------------------------------------------


async def test_failover_replays_the_exact_body(clock: FakeClock) -> None:
    raw = (
        b'{ "model" : "m",  "max_tokens": 16,\n "messages": [{"role":"user", "content":"\\u00e9"}]}'
    )
    upstream = Upstream({"a": 500, "b": 500})
    app, _ = stack(upstream, account("a"), account("b"), account("c", priority=1), clock=clock)
    async with http(app) as client:
        await client.post(MESSAGES, content=raw, headers={"content-type": "application/json"})
    assert [who for who, _ in upstream.seen] == ["a", "b", "c"]
    assert {body for _, body in upstream.seen} == {raw}


async def test_failover_replays_the_rewritten_body(clock: FakeClock) -> None:
    upstream = Upstream({"a": 503})
    accounts = [account("a", models=("m-v",)), account("b", models=("m-v",), priority=1)]
    app, _ = stack(upstream, *accounts, clock=clock, canary=True)
    async with http(app) as client:
        response = await client.post(MESSAGES, json=BODY)
    assert response.headers["x-switchyard-model"] == "m-v"
    (_, first), (_, second) = upstream.seen
    assert first == second
    assert json.loads(first) == {**BODY, "model": "m-v"}


async def test_no_failover_once_the_response_started(
    clock: FakeClock, otel_metrics: Metrics
) -> None:
    seen: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(client_name())
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"part", "more_body": True})
        raise httpx.RemoteProtocolError("upstream stream broke")

    gateway, pool = stack(
        app, account("a", failure_threshold=3), account("b", priority=1), clock=clock
    )
    faults = otel_metrics.value(tm.ACCOUNT_FAULTS, **{tm.ACCOUNT: "a"}, status="transport_error")
    async with http(gateway) as client:
        with pytest.raises(httpx.RemoteProtocolError, match="stream broke"):
            await client.post(MESSAGES, json=BODY)
    assert seen == ["a"]
    assert pool.status_of("a").consecutive_faults == 1
    assert (
        otel_metrics.value(tm.ACCOUNT_FAULTS, **{tm.ACCOUNT: "a"}, status="transport_error")
        == faults + 1
    )


async def test_a_bug_in_the_app_is_not_an_account_fault(clock: FakeClock) -> None:
    seen: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(client_name())
        raise KeyError("a bug in the gateway's own code")

    gateway, pool = stack(app, account("a", failure_threshold=1), account("b"), clock=clock)
    async with http(gateway) as client:
        with pytest.raises(KeyError):
            await client.post(MESSAGES, json=BODY)
    assert len(seen) == 1  # no failover: another account would hit the same bug
    assert all(pool.status_of(n).consecutive_faults == 0 for n in ("a", "b"))


async def test_oversized_error_body_is_forwarded_without_failover(clock: FakeClock) -> None:
    chunk = b"x" * (MAX_HELD_BYTES // 2 + 1)
    seen: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(client_name())
        await send({"type": "http.response.start", "status": 500, "headers": []})
        for more in (True, True, True, False):
            await send({"type": "http.response.body", "body": chunk, "more_body": more})

    gateway, pool = stack(app, account("a"), account("b", priority=1), clock=clock)
    async with http(gateway) as client:
        response = await client.post(MESSAGES, json=BODY)
    assert (response.status_code, len(response.content)) == (500, 4 * len(chunk))
    assert seen == ["a"]
    assert pool.status_of("a").state is BreakerState.COOLED  # the outcome still counts


async def test_success_chunks_pass_through_at_once_uncopied(clock: FakeClock) -> None:
    to_client: list[Message] = []
    chunks = [
        {"type": "http.response.body", "body": b"data: %d\n\n" % i, "more_body": True}
        for i in range(3)
    ]

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for chunk in chunks:
            await send(chunk)
            assert to_client[-1] is chunk  # forwarded before the next one is made: no buffering
        await send({"type": "http.response.body", "body": b""})

    async def record(message: Message) -> None:
        to_client.append(message)

    gateway, pool = stack(app, account("a"), clock=clock)
    await gateway(_scope(), _receive(json.dumps(BODY).encode()), record)
    assert [m["type"] for m in to_client] == ["http.response.start", *["http.response.body"] * 4]
    assert pool.status_of("a").consecutive_faults == 0


async def test_connection_error_fails_over(clock: FakeClock, otel_metrics: Metrics) -> None:
    upstream = Upstream({"a": httpx.ConnectError("connection refused")})
    app, pool = stack(upstream, account("a"), account("b", priority=1), clock=clock)
    faults = otel_metrics.value(tm.ACCOUNT_FAULTS, **{tm.ACCOUNT: "a"}, status="connect_error")
    async with http(app) as client:
        response = await client.post(MESSAGES, json=BODY)
    assert (response.status_code, response.headers["x-switchyard-attempts"]) == (200, "2")
    assert pool.status_of("a").state is BreakerState.COOLED
    assert (
        otel_metrics.value(tm.ACCOUNT_FAULTS, **{tm.ACCOUNT: "a"}, status="connect_error")
        == faults + 1
    )


@pytest.mark.parametrize(
    ("path", "body", "error"),
    [
        (MESSAGES, BODY, lambda j: j["error"]["type"]),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            lambda j: j["error"]["code"],
        ),
    ],
)
async def test_unreachable_everywhere_is_a_502_in_the_wire_format(
    path: str, body: dict[str, Any], error: Any, clock: FakeClock
) -> None:
    upstream = Upstream({"a": httpx.ConnectError("refused"), "b": OSError("unreachable")})
    app, _ = stack(upstream, account("a"), account("b", priority=1), clock=clock)
    async with http(app) as client:
        response = await client.post(path, json=body)
    assert response.status_code == 502
    assert error(response.json()) == "upstream_unreachable"
    assert response.headers["x-switchyard-attempts"] == "2"


# --- time ------------------------------------------------------------------------------------


async def test_spent_budget_stops_failover(clock: FakeClock) -> None:
    upstream = Upstream({"a": 500}, delay={"a": 0.25})
    app, pool = stack(upstream, account("a"), account("b", priority=1), clock=clock)
    async with http(app) as client:
        response = await client.post(
            MESSAGES, json=BODY, headers={"x-switchyard-timeout-ms": "100"}
        )
    assert (response.status_code, response.headers["x-switchyard-attempts"]) == (500, "1")
    assert upstream.calls("b") == 0
    assert pool.status_of("a").state is BreakerState.COOLED  # it did answer 500


async def test_budget_deadline_is_nobodys_fault(
    clock: FakeClock, spans: InMemorySpanExporter
) -> None:
    upstream = Upstream(delay={"a": 5.0})
    cooling = CoolingMiddleware(
        DeadlineMiddleware(upstream),
        accounts={"a": account("a"), "b": account("b", priority=1)},
        clock=clock,
    )
    async with http(cooling) as client:
        response = await client.post(
            MESSAGES, json=BODY, headers={"x-switchyard-timeout-ms": "100"}
        )
    assert response.status_code == 504
    assert response.json()["error"]["type"] == "deadline_exceeded"
    assert upstream.calls("b") == 0
    status = cooling.pool.status_of("a")
    assert (status.state, status.consecutive_faults) == (BreakerState.CLOSED, 0)
    (attempt,) = [s for s in spans.get_finished_spans() if s.name == tm.SPAN_ATTEMPT]
    assert dict(attempt.attributes or {})[tm.ATTEMPT_OUTCOME] == "none"


async def test_attempt_deadline_is_a_fault(clock: FakeClock, otel_metrics: Metrics) -> None:
    upstream = Upstream(delay={"a": 5.0})
    accounts = {"a": account("a", timeout_secs=0.05), "b": account("b", priority=1)}
    cooling = CoolingMiddleware(DeadlineMiddleware(upstream), accounts=accounts, clock=clock)
    faults = otel_metrics.value(tm.ACCOUNT_FAULTS, **{tm.ACCOUNT: "a"}, status="deadline")
    async with http(cooling) as client:
        response = await client.post(MESSAGES, json={**BODY, "max_tokens": 1})
    assert (response.status_code, response.headers["x-switchyard-account"]) == (200, "b")
    assert (
        otel_metrics.value(tm.ACCOUNT_FAULTS, **{tm.ACCOUNT: "a"}, status="deadline") == faults + 1
    )


async def test_all_cooled_is_a_503_with_retry_after(
    clock: FakeClock, spans: InMemorySpanExporter
) -> None:
    upstream = Upstream({"a": 500, "b": 500})
    accounts = [account("a", cooldown_secs=30.0), account("b", priority=1, cooldown_secs=45.0)]
    app, pool = stack(upstream, *accounts, clock=clock)
    async with http(app) as client:
        first = await client.post(MESSAGES, json=BODY)
        clock.now += 10
        second = await client.post(MESSAGES, json=BODY)
        clock.now += 20
        upstream.script["a"] = 200
        spans.clear()
        third = await client.post(MESSAGES, json=BODY)
    assert (first.status_code, first.headers["x-switchyard-account"]) == (500, "b")
    assert second.status_code == 503
    assert second.headers["retry-after"] == "20"
    assert second.json() == {
        "type": "error",
        "error": {
            "type": "no_healthy_account",
            "message": "no healthy upstream account for model 'm'",
        },
    }
    assert "x-switchyard-attempts" not in second.headers
    assert (third.status_code, third.headers["x-switchyard-account"]) == (200, "a")
    (probe,) = [s for s in spans.get_finished_spans() if s.name == tm.SPAN_ATTEMPT]
    assert dict(probe.attributes or {})[tm.ATTEMPT_PROBE] is True
    assert pool.status_of("a").state is BreakerState.CLOSED


async def test_disconnect_releases_the_probe(clock: FakeClock) -> None:
    started = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        started.set()
        await asyncio.sleep(30)

    gateway, pool = stack(app, account("a"), clock=clock)
    cool(pool, "a")
    clock.now += 31  # the probe is due

    body_sent = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": json.dumps(BODY).encode(), "more_body": False}
        await started.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        raise AssertionError("nothing is sent to a client that left")

    async with asyncio.timeout(5):
        await gateway(_scope(), receive, send)
    status = pool.status_of("a")
    assert (status.state, status.probe_in_flight, status.consecutive_faults) == (
        BreakerState.HALF_OPEN,
        False,
        1,
    )


async def test_after_work_runs_and_outcome_counts_once_the_response_ended(
    clock: FakeClock,
) -> None:
    """uvicorn reports a disconnect once a response is complete: that must cancel nothing."""
    finished = asyncio.Event()
    after_work_done = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
        await asyncio.sleep(0.05)  # e.g. a background task closing the upstream response
        after_work_done.set()

    gateway, pool = stack(app, account("a"), clock=clock)
    cool(pool, "a")
    clock.now += 31  # this request is the probe
    body_sent = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": json.dumps(BODY).encode(), "more_body": False}
        await finished.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            finished.set()

    async with asyncio.timeout(5):
        await gateway(_scope(), receive, send)
    assert after_work_done.is_set()
    status = pool.status_of("a")
    assert (status.state, status.consecutive_faults) == (BreakerState.CLOSED, 0)


# --- canary fallback -------------------------------------------------------------------------


async def test_unpinned_canary_falls_back_to_the_requested_model(clock: FakeClock) -> None:
    upstream = Upstream({"v": 500})
    app, _ = stack(
        upstream,
        account("v", models=("m-v",)),
        account("base", models=("m",)),
        clock=clock,
        canary=True,
    )
    async with http(app) as client:
        first = await client.post(MESSAGES, json=BODY)
        second = await client.post(MESSAGES, json=BODY)  # "v" is cooling now
    assert (first.status_code, first.headers["x-switchyard-attempts"]) == (200, "2")
    assert first.headers["x-switchyard-model"] == "m"
    assert [(who, json.loads(body)["model"]) for who, body in upstream.seen] == [
        ("v", "m-v"),
        ("base", "m"),
        ("base", "m"),
    ]
    assert (second.headers["x-switchyard-attempts"], second.headers["x-switchyard-model"]) == (
        "1",
        "m",
    )


async def test_pinned_conversation_never_leaves_its_model(clock: FakeClock) -> None:
    upstream = Upstream({"v": 500})
    app, _ = stack(
        upstream,
        account("v", models=("m-v",)),
        account("base", models=("m",)),
        clock=clock,
        canary=True,
    )
    async with http(app) as client:
        first = await client.post(MESSAGES, json=THINKING_BODY)
        second = await client.post(MESSAGES, json=THINKING_BODY)
    assert (first.status_code, first.headers["x-switchyard-model"]) == (500, "m-v")
    assert second.status_code == 503
    assert second.headers["retry-after"] == "30"
    assert upstream.calls("base") == 0


# --- pass-through, telemetry, operator view --------------------------------------------------


async def test_requests_it_cannot_route_pass_through(clock: FakeClock) -> None:
    upstream = Upstream()
    app, _ = stack(upstream, account("a"), clock=clock)
    async with http(app) as client:
        other = await client.post(MESSAGES, json={**BODY, "model": "unknown"})
        health = await client.get("/health")
    assert (other.status_code, health.status_code) == (200, 200)
    assert [who for who, _ in upstream.seen] == ["-", "-"]
    assert "x-switchyard-attempts" not in other.headers


async def test_one_attempt_span_per_attempt(clock: FakeClock, spans: InMemorySpanExporter) -> None:
    upstream = Upstream({"a": 401})
    app, _ = stack(upstream, account("a"), account("b", priority=1), clock=clock)
    async with http(app) as client:
        await client.post(MESSAGES, json=BODY)
    finished = spans.get_finished_spans()
    (request,) = [s for s in finished if s.name == tm.SPAN_REQUEST]
    attempts = [s for s in finished if s.name == tm.SPAN_ATTEMPT]
    assert [dict(s.attributes or {}) for s in attempts] == [
        {
            tm.ACCOUNT: "a",
            tm.ATTEMPT_PROBE: False,
            tm.REQUEST_MODEL: "m",
            tm.ATTEMPT_STATUS: "401",
            tm.ATTEMPT_OUTCOME: "fault",
        },
        {
            tm.ACCOUNT: "b",
            tm.ATTEMPT_PROBE: False,
            tm.REQUEST_MODEL: "m",
            tm.ATTEMPT_STATUS: "200",
            tm.ATTEMPT_OUTCOME: "success",
        },
    ]
    assert all(
        s.parent is not None and s.parent.span_id == request.context.span_id for s in attempts
    )


async def test_status_app_shows_state_and_no_secret(clock: FakeClock) -> None:
    accounts = {"a": account("a"), "b": account("b")}
    pool = pool_from_accounts(accounts, clock=clock)
    cool(pool, "a")
    pool.hold("b", "m", 40.0)  # a 429's retry time: held for that model, not cooled
    clock.now += 12
    async with http(cooling_status_app(pool, clock=clock)) as client:
        response = await client.get("/")
        refused = await client.post("/")
    assert response.json() == {
        "accounts": [
            {
                "name": "a",
                "state": "cooled",
                "consecutive_faults": 1,
                "cooled_for_secs": 18.0,
                "current_cooldown_secs": 30.0,
                "cause": "outage",
                "probe_in_flight": False,
                "probe_due": False,
                "held_for_secs": {},
                "models": {},
            },
            {
                "name": "b",
                "state": "closed",
                "consecutive_faults": 0,
                "cooled_for_secs": None,
                "current_cooldown_secs": 30.0,
                "cause": None,
                "probe_in_flight": False,
                "probe_due": False,
                "held_for_secs": {"m": 28.0},
                "models": {},
            },
        ]
    }
    assert b"sk-secret" not in response.content
    assert refused.status_code == 405


async def test_status_app_shows_half_open_once_the_period_ran_out_with_no_request(
    clock: FakeClock,
) -> None:
    accounts = {"a": account("a"), "dual": account("dual", models=("m", "n"))}
    pool = pool_from_accounts(accounts, clock=clock)
    cool(pool, "a")
    cool(pool, "dual")  # a 5xx of an account serving two models: its pair for "m" cools
    app = cooling_status_app(pool, clock=clock)

    def fields(entry: dict[str, Any]) -> tuple[object, ...]:
        keys = ("state", "cooled_for_secs", "probe_in_flight", "probe_due")
        return tuple(entry[k] for k in keys)

    async def page() -> tuple[tuple[object, ...], tuple[object, ...]]:
        async with http(app) as client:
            a, dual = (await client.get("/")).json()["accounts"]
        return fields(a), fields(dual["models"]["m"])

    clock.now += 29.999
    assert await page() == (("cooled", 0.001, False, False),) * 2
    clock.now += 0.001  # the period's end: no request came, the probe is due
    assert await page() == (("half_open", None, False, True),) * 2
    clock.now += 600.0
    assert await page() == (("half_open", None, False, True),) * 2
    lease = pool.acquire("m", allowed=["a"])
    assert lease is not None
    assert lease.probe
    assert (await page())[0] == ("half_open", None, True, False)


def _scope() -> Scope:
    return {
        "type": "http",
        "method": "POST",
        "path": MESSAGES,
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
    }


def _receive(body: bytes) -> Receive:
    sent = False
    never = asyncio.Event()

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await never.wait()
        return {"type": "http.disconnect"}

    return receive


# --- a framework between the policy and the app's transport error ---------------------------


def framework_500(
    *, reraise: bool, reported: bool = True, error_type: type[httpx.HTTPError] = httpx.ConnectError
) -> ASGIApp:
    """An app whose upstream call failed in transport, as its framework answers it: Starlette
    and FastAPI send their own 500 and re-raise; Litestar and Django send it and return."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        ctx = current_context()
        error = error_type("refused")
        if reported and ctx is not None:
            ctx.report_transport_error(error)
        start = {"type": "http.response.start", "status": 500, "headers": []}
        await send(start)
        await send({"type": "http.response.body", "body": b"Internal Server Error"})
        if reraise:
            raise error

    return app


@pytest.mark.parametrize(
    ("reraise", "reported"), [(True, False), (True, True), (False, True)], ids=str
)
async def test_a_frameworks_500_for_a_transport_error_is_502_upstream_unreachable(
    clock: FakeClock, otel_metrics: Metrics, reraise: bool, reported: bool
) -> None:
    app, pool = stack(framework_500(reraise=reraise, reported=reported), account("a"), clock=clock)
    before = otel_metrics.value(tm.ACCOUNT_FAULTS, **{tm.ACCOUNT: "a"}, status="connect_error")
    async with http(app) as client:
        response = await client.post(MESSAGES, json=BODY)
    assert response.status_code == 502
    assert response.json()["error"]["type"] == "upstream_unreachable"
    assert response.headers["x-switchyard-attempts"] == "1"
    assert pool.status_of("a").consecutive_faults == 1
    after = otel_metrics.value(tm.ACCOUNT_FAULTS, **{tm.ACCOUNT: "a"}, status="connect_error")
    assert after == before + 1


@pytest.mark.parametrize("reraise", [True, False], ids=["reraised", "answered"])
async def test_a_frameworks_500_for_the_calls_own_timeout_is_504_deadline_exceeded(
    clock: FakeClock, reraise: bool
) -> None:
    failing = framework_500(reraise=reraise, error_type=httpx.ReadTimeout)
    app, _ = stack(failing, account("a"), clock=clock)
    async with http(app) as client:
        response = await client.post(MESSAGES, json=BODY)
    assert response.status_code == 504
    assert response.json()["error"]["type"] == "deadline_exceeded"


async def test_a_frameworks_500_for_a_transport_error_fails_over(clock: FakeClock) -> None:
    failing = framework_500(reraise=False)
    good = Upstream()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await (failing if client_name() == "a" else good)(scope, receive, send)

    outer, _ = stack(app, account("a"), account("b", priority=1), clock=clock)
    async with http(outer) as client:
        response = await client.post(MESSAGES, json=BODY)
    assert (response.status_code, response.json()) == (200, {"account": "b"})
    assert response.headers["x-switchyard-attempts"] == "2"


async def test_a_5xx_without_a_transport_error_is_passed_on_once_the_app_ends(
    clock: FakeClock,
) -> None:
    upstream = Upstream({"a": 503})
    app, _ = stack(upstream, account("a", failure_threshold=5), clock=clock)
    async with http(app) as client:
        response = await client.post(MESSAGES, json=BODY)
    assert (response.status_code, response.json()) == (503, {"account": "a"})


def test_built_alone_from_the_config_or_from_clients_not_both(tmp_path: Any) -> None:
    path = tmp_path / "switchyard.toml"
    path.write_text('[llm_clients.a]\nbase_url = "http://a.test"\nmodels = ["m"]\n')
    cooling = CoolingMiddleware(Upstream(), config=path)
    assert list(cooling.accounts) == ["a"]
    assert cooling.pool.accounts_for("m") == ("a",)
    with pytest.raises(TypeError):
        CoolingMiddleware(Upstream())
    with pytest.raises(TypeError):
        CoolingMiddleware(Upstream(), config=path, accounts=cooling.accounts)
