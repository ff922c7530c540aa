"""Tenants in `switchyard_stack`, in process: the stack asks `engine.tenancy` and translates.
The app's own name (`name_tenant`) and the trusted header, a 401 before the judge is called,
the reservation given back when every attempt failed, kept when the answer started without
usage, given back when the client left before an answer, and `switchyard.tenant` on the
request metrics."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from redis_server import running_redis, until
from switchyard_mw.asgi._types import ASGIApp, Message, Receive, Scope, Send
from switchyard_mw.asgi.stack import SwitchyardStack, switchyard_stack
from switchyard_mw.config import parse_config
from switchyard_mw.context import current_context, name_tenant
from switchyard_mw.state._limits_lua import MERGE, RESERVE, SETTLE
from switchyard_mw.state.redis_limits import RedisLimits
from switchyard_mw.telemetry import names as tm
from switchyard_mw.telemetry import request_metrics as rm

KEY = "sk-team"
CONFIG = f"""
[llm_clients.a]
base_url = "http://a.test"
api_key_env = "KEY_A"
models = ["m", "judge-m"]
[routes.auto]
classifier = "llm"
judge = "a"
judge_model = "judge-m"
choices = {{ simple = "m", complex = "m" }}
fallback = "m"
[tenants.team]
keys = ["sha256:{hashlib.sha256(KEY.encode()).hexdigest()}"]
models = ["m", "auto"]
limits = [{{ tokens = 100_000, per = "day" }}]
[tenants.other]
[server]
tenant_header = "x-switchyard-tenant"
"""
BODY = {"model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]}


class Upstream:
    """The app behind the stack: answers as told, and counts its calls."""

    def __init__(self, *, status: int = 200, usage: bool = True) -> None:
        self.status = status
        self.usage = usage
        self.calls = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.calls += 1
        await receive()
        ctx = current_context()
        assert ctx is not None
        if self.usage and self.status == 200:
            ctx.report_usage(input_tokens=11, output_tokens=4)
        body = b'{"type":"message","content":[]}'
        headers = [(b"content-type", b"application/json"), (b"x-ratelimit-limit-tokens", b"9")]
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def stack_for(app: ASGIApp, judge: httpx.AsyncClient | None = None) -> SwitchyardStack:
    return switchyard_stack(
        app,
        config=parse_config(CONFIG),
        environ={"KEY_A": "acct"},
        judge_http_client=judge,
        reload_on_signal=False,
    )


def used(stack: SwitchyardStack) -> float:
    tenancy = stack.tenancy
    assert tenancy is not None
    (limit,) = tenancy.rules["team"].limits
    return tenancy.store.used(limit)


async def post(
    app: ASGIApp, headers: dict[str, str], body: dict[str, Any] = BODY
) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        return await client.post("/v1/messages", json=body, headers=headers)


def test_an_apps_own_authentication_names_the_tenant() -> None:
    upstream = Upstream()
    stack = stack_for(upstream)

    async def authenticated(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            name_tenant(scope, "team")  # beats the (wrong) key the client sent
        await stack(scope, receive, send)

    answer = asyncio.run(post(authenticated, {"x-api-key": "not-a-key"}))
    assert answer.status_code == 200
    assert answer.headers["anthropic-ratelimit-tokens-limit"] == "100000"
    assert "x-ratelimit-limit-tokens" not in answer.headers  # the account's gave way
    assert used(stack) == 15


def test_the_trusted_header_names_the_tenant() -> None:
    stack = stack_for(Upstream())
    answer = asyncio.run(post(stack, {"x-switchyard-tenant": "other"}))
    assert answer.status_code == 200
    # A tenant without limits: nothing to report.
    assert "anthropic-ratelimit-tokens-limit" not in answer.headers
    refused = asyncio.run(post(stack, {"x-switchyard-tenant": "nobody", "x-api-key": KEY}))
    assert refused.status_code == 401


def test_a_wrong_key_is_refused_before_the_judge_is_called() -> None:
    judged: list[httpx.Request] = []

    def judge(request: httpx.Request) -> httpx.Response:
        judged.append(request)
        return httpx.Response(500)

    upstream = Upstream()
    client = httpx.AsyncClient(transport=httpx.MockTransport(judge))
    stack = stack_for(upstream, judge=client)
    answer = asyncio.run(post(stack, {"x-api-key": "sk-nope"}, {**BODY, "model": "auto"}))
    assert answer.status_code == 401
    assert answer.json()["error"]["type"] == "authentication_error"
    assert answer.headers["x-should-retry"] == "false"
    assert judged == []
    assert upstream.calls == 0
    forbidden = asyncio.run(post(stack, {"x-api-key": KEY}, {**BODY, "model": "judge-m"}))
    assert forbidden.status_code == 403
    assert judged == []
    assert upstream.calls == 0


@pytest.mark.parametrize(
    ("status", "usage", "kept"),
    [
        (200, True, 15.0),  # the answer's usage
        # Started, no usage: kept whole (max_tokens + the compact body's bytes / 3, up).
        (200, False, 100.0 + -(-len(json.dumps(BODY, separators=(",", ":"))) // 3)),
        (500, False, 0.0),  # every attempt failed: given back
        (400, False, 0.0),  # the provider refused it: nothing billed
    ],
)
def test_what_a_finished_request_keeps(status: int, usage: bool, kept: float) -> None:
    stack = stack_for(Upstream(status=status, usage=usage))
    answer = asyncio.run(post(stack, {"authorization": f"Bearer {KEY}"}))
    assert answer.status_code == status
    assert used(stack) == kept
    assert answer.headers["anthropic-ratelimit-tokens-limit"] == "100000"


def test_a_client_that_leaves_before_an_answer_gives_the_reservation_back() -> None:
    started = asyncio.Event()

    async def slow(scope: Scope, receive: Receive, send: Send) -> None:
        started.set()
        await asyncio.sleep(30)

    stack = stack_for(slow)

    async def run() -> None:
        task = asyncio.create_task(post(stack, {"x-api-key": KEY}))
        await started.wait()
        assert used(stack) > 0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0)  # the settle's own task

    asyncio.run(run())
    assert used(stack) == 0


def test_the_request_metrics_carry_the_tenant_never_the_key() -> None:
    stack = stack_for(Upstream())
    asyncio.run(post(stack, {"x-api-key": KEY}))
    rm.requests.fold()
    tokens = [labels for labels in rm.token_usage._series if labels[-1] == "team"]
    assert tokens
    assert all(KEY not in label for labels in rm.duration._series for label in labels)
    points = [p.attributes for p in rm.duration.metric(0).data.data_points]  # type: ignore[union-attr]
    # The metrics are the session's: other tests' tenants named "team" may have points too.
    wanted = {"gen_ai.request.model": "m", tm.TENANT: "team"}.items()
    assert any(wanted <= p.items() for p in points)


def test_a_reload_keeps_what_was_spent() -> None:
    stack = stack_for(Upstream())
    asyncio.run(post(stack, {"x-api-key": KEY}))
    assert used(stack) == 15
    before = stack.tenancy
    assert stack.reload(parse_config(CONFIG.replace("100_000", "100_000 "))) == []
    assert stack.tenancy is not before  # the new config's decisions ...
    assert used(stack) == 15  # ... over the same counters
    without = parse_config(CONFIG.split("[tenants.team]")[0] + "[server]\n")
    assert stack.reload(without) == []
    assert stack.tenancy is None
    answer = asyncio.run(post(stack, {"x-api-key": "anything"}))
    assert answer.status_code == 200
    assert "anthropic-ratelimit-tokens-limit" not in answer.headers


def test_an_unread_llm_call_still_needs_a_known_key() -> None:
    upstream = Upstream()
    stack = stack_for(upstream)

    async def raw(headers: dict[str, str]) -> httpx.Response:
        transport = httpx.ASGITransport(app=stack)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            return await client.post(
                "/v1/messages",
                content=b"not json",
                headers={"content-type": "text/plain", **headers},
            )

    refused = asyncio.run(raw({"x-api-key": "sk-nope"}))
    assert refused.status_code == 401
    assert refused.json()["error"]["type"] == "authentication_error"
    assert upstream.calls == 0
    let_through = asyncio.run(raw({"x-api-key": KEY}))
    assert upstream.calls == 1
    assert let_through.status_code == 200


def test_a_token_count_is_identified_but_reserves_nothing() -> None:
    upstream = Upstream(usage=False)
    stack = stack_for(upstream)

    async def count(key: str) -> httpx.Response:
        transport = httpx.ASGITransport(app=stack)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            return await client.post(
                "/v1/messages/count_tokens", json=body, headers={"x-api-key": key}
            )

    assert asyncio.run(count("sk-nope")).status_code == 401
    assert upstream.calls == 0
    counted = asyncio.run(count(KEY))
    assert counted.status_code == 200
    assert upstream.calls == 1
    assert used(stack) == 0  # free at the provider: nothing held, nothing kept


@pytest.mark.integration  # starts a redis-server
async def test_lifespan_startup_connects_the_redis_limit_store_before_the_first_request(
    tmp_path: Path,
) -> None:
    """A Redis that answers only after 300 ms (3 x timeout_ms) while the server starts: the
    startup waits for it (the limit store's start-up time, not its timeout), so the first
    request finds the store connected, its scripts loaded, and no outage."""
    with contextlib.contextmanager(running_redis)(tmp_path) as redis:
        state = f'[state]\nbackend = "redis"\nurl = "{redis.url}"\ntimeout_ms = 100\n'
        upstream = Upstream()

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "lifespan":
                return await upstream(scope, receive, send)
            while (kind := (await receive())["type"].removeprefix("lifespan.")) != "shutdown":
                await send({"type": f"lifespan.{kind}.complete"})
            await send({"type": "lifespan.shutdown.complete"})

        stack = switchyard_stack(
            app,
            config=parse_config(CONFIG + state),
            environ={"KEY_A": "acct"},
            reload_on_signal=False,
        )
        store = stack.limit_store
        assert isinstance(store, RedisLimits)
        inbox = asyncio.Queue[Message]()
        inbox.put_nowait({"type": "lifespan.startup"})
        outbox: list[Message] = []

        async def send(message: Message) -> None:
            outbox.append(message)

        redis.pause()
        asyncio.get_running_loop().call_later(0.3, redis.resume)
        lifespan = asyncio.create_task(stack({"type": "lifespan"}, inbox.get, send))
        await until(lambda: bool(outbox), within=5.0)
        assert outbox == [{"type": "lifespan.startup.complete"}]
        assert store.healthy
        async with aioredis.Redis.from_url(redis.url) as raw:
            loaded = await raw.script_exists(*(s.sha for s in (RESERVE, SETTLE, MERGE)))
        assert loaded == [True, True, True]
        assert (await post(stack, {"x-api-key": KEY})).status_code == 200
        assert store.healthy
        inbox.put_nowait({"type": "lifespan.shutdown"})
        await lifespan
        await stack.aclose()
