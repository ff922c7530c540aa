"""Config reload of the ASGI stack, in process: what changes, what is kept, what is refused."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import httpx
import pytest

from conftest import Metrics
from switchyard_mw.asgi._types import Receive, Scope, Send
from switchyard_mw.asgi.admin import OperatorOnly, ReloadApp
from switchyard_mw.asgi.stack import SwitchyardStack, switchyard_stack
from switchyard_mw.config import load_config
from switchyard_mw.context import context_of
from switchyard_mw.core.pool import BreakerState

ENV = {"KEY_A": "a", "KEY_B": "b"}


def config_text(
    *,
    percent: float = 0.0,
    a_url: str = "http://a.test",
    a_name: str = "acct-a",
    extra: str = "",
) -> str:
    return f"""
[llm_clients.{a_name}]
base_url = "{a_url}"
api_key_env = "KEY_A"
models = ["base", "var"]
failure_threshold = 1
cooldown_secs = 60

[llm_clients.acct-b]
base_url = "http://b.test"
api_key_env = "KEY_B"
models = ["other"]
failure_threshold = 1
cooldown_secs = 60

[canaries.base]
variants = {{ var = {percent} }}
{extra}
"""


class Upstream:
    """The app behind the stack: answers with the account and model it was given; a
    request whose user id is `hold` waits until `release` is set; `status` for account a."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.waiting = asyncio.Event()
        self.status_a = 200

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ctx = context_of(scope)
        assert ctx is not None
        assert ctx.account is not None
        if ctx.view is not None and ctx.view.user_key == "hold":
            self.waiting.set()
            await self.release.wait()
        status = self.status_a if ctx.account.spec.api_key_env == "KEY_A" else 200
        body = f"{ctx.account.name} {ctx.resolved_model}".encode()
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": body})


def stack_for(tmp_path: Path, text: str) -> tuple[SwitchyardStack, Upstream, Path]:
    path = tmp_path / "switchyard.toml"
    path.write_text(text)
    upstream = Upstream()
    stack = switchyard_stack(upstream, config=path, environ=ENV, reload_on_signal=False)
    return stack, upstream, path


async def ask(
    stack: SwitchyardStack, user: str, model: str = "base"
) -> tuple[int, str, httpx.Headers]:
    transport = httpx.ASGITransport(app=stack)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        answer = await client.post(
            "/v1/chat/completions",
            json={"model": model, "user": user, "messages": [{"role": "user", "content": "hi"}]},
        )
    return answer.status_code, answer.text, answer.headers


async def test_new_requests_get_the_new_split(tmp_path: Path) -> None:
    stack, _, path = stack_for(tmp_path, config_text(percent=0))
    assert {(await ask(stack, f"u{i}"))[1] for i in range(20)} == {"acct-a base"}
    path.write_text(config_text(percent=100))
    assert stack.reload() == []
    assert {(await ask(stack, f"u{i}"))[1] for i in range(20)} == {"acct-a var"}


async def test_a_request_under_way_finishes_on_the_config_it_started_with(tmp_path: Path) -> None:
    stack, upstream, path = stack_for(tmp_path, config_text(percent=0))
    held = asyncio.create_task(ask(stack, "hold"))
    await upstream.waiting.wait()
    path.write_text(config_text(percent=100, a_name="acct-c"))
    assert stack.reload() == []
    assert (await ask(stack, "u1"))[1] == "acct-c var"
    upstream.release.set()
    status, text, headers = await held
    assert (status, text) == (200, "acct-a base")
    assert headers["x-switchyard-account"] == "acct-a"


async def test_account_health_is_kept_unless_name_or_base_url_changed(tmp_path: Path) -> None:
    stack, upstream, path = stack_for(tmp_path, config_text())
    upstream.status_a = 500
    assert (await ask(stack, "u1"))[0] == 500
    assert stack.pool.status_of("acct-a", model="base").state is BreakerState.COOLED
    # Same accounts: acct-a stays cooled for base (u1 stays on base at 1 %; var, another
    # model of acct-a, has its own health).
    path.write_text(config_text(percent=1))
    assert stack.reload() == []
    assert stack.pool.status_of("acct-a", model="base").state is BreakerState.COOLED
    assert (await ask(stack, "u1"))[0] == 503
    path.write_text(config_text(percent=1, a_url="http://a2.test"))  # a new endpoint
    assert stack.reload() == []
    assert stack.pool.status_of("acct-a", model="base").state is BreakerState.CLOSED


async def test_an_outcome_recorded_after_the_reload_reaches_the_new_pool(tmp_path: Path) -> None:
    stack, upstream, path = stack_for(tmp_path, config_text())
    upstream.status_a = 500
    held = asyncio.create_task(ask(stack, "hold"))
    await upstream.waiting.wait()
    path.write_text(config_text(percent=10))
    assert stack.reload() == []
    upstream.release.set()
    assert (await held)[0] == 500
    assert stack.pool.status_of("acct-a", model="base").state is BreakerState.COOLED


async def test_a_broken_config_is_refused_whole(
    tmp_path: Path, otel_metrics: Metrics, caplog: pytest.LogCaptureFixture
) -> None:
    stack, _, path = stack_for(tmp_path, config_text(percent=0))
    before = stack.config
    ok = otel_metrics.value("switchyard.config.reloads", result="ok")
    rejected = otel_metrics.value("switchyard.config.reloads", result="rejected")
    path.write_text(config_text(percent=100, extra="[canaries.nobody]\nvariants = { var = 1 }\n"))
    path.write_text(path.read_text().replace("cooldown_secs = 60", "cooldown_secs = -1", 1))
    with caplog.at_level(logging.ERROR, logger="switchyard_mw.engine.reload"):
        problems = stack.reload()
    assert any("cooldown_secs" in p and "acct-a" in p for p in problems)
    assert any(p.startswith("canaries.nobody") for p in problems)
    assert stack.config is before
    assert {(await ask(stack, f"u{i}"))[1] for i in range(10)} == {"acct-a base"}
    assert otel_metrics.value("switchyard.config.reloads", result="rejected") == rejected + 1
    assert otel_metrics.value("switchyard.config.reloads", result="ok") == ok
    assert "config reload rejected" in caplog.text
    assert "cooldown_secs" in caplog.text


async def test_an_unset_key_variable_refuses_the_reload(tmp_path: Path) -> None:
    stack, _, path = stack_for(tmp_path, config_text())
    path.write_text(config_text().replace('"KEY_B"', '"KEY_NEW"'))
    problems = stack.reload()
    assert problems == ["llm_clients.acct-b.api_key_env: environment variable KEY_NEW is not set"]


async def test_a_changed_state_table_waits_for_a_restart(tmp_path: Path) -> None:
    stack, _, path = stack_for(tmp_path, config_text())
    path.write_text(config_text(extra='[state]\nkey_prefix = "other"\n'))
    assert [p.split(":")[0] for p in stack.reload()] == ["state"]


async def test_a_reload_re_arms_the_canary_guard(tmp_path: Path) -> None:
    guard = "guard = { max_fault_rate = 0.1, min_requests = 5, window_secs = 60 }\n"
    text = config_text(percent=100) + guard
    stack, _, _ = stack_for(tmp_path, text)
    stack.variant.canaries.trip("base", "var")
    assert (await ask(stack, "u1"))[1] == "acct-a base"
    assert stack.reload() == []
    assert stack.cooling.guard is stack.variant.canaries  # outcomes feed the new guard
    assert not stack.variant.canaries.tripped("base", "var")
    assert (await ask(stack, "u1"))[1] == "acct-a var"


async def test_a_stack_given_a_config_object_reloads_only_what_it_is_handed(
    tmp_path: Path,
) -> None:
    stack, _, path = stack_for(tmp_path, config_text(percent=0))
    plain = SwitchyardStack(stack.app, config=stack.config, accounts=stack.accounts, environ=ENV)
    assert plain.reload() != []
    path.write_text(config_text(percent=100))
    assert plain.reload(load_config(path)) == []
    assert plain.config.canaries["base"].variants == {"var": 100.0}


# --- the operator routes ----------------------------------------------------------------------


async def call(app: OperatorOnly, client: tuple[str, int], method: str = "POST") -> int:
    transport = httpx.ASGITransport(app=app, client=client)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
        return (await http.request(method, "/switchyard/reload")).status_code


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "::ffff:127.0.0.1"])
async def test_loopback_may_call_operator_routes(host: str) -> None:
    assert await call(OperatorOnly(ReloadApp(lambda: [])), (host, 5000)) == 200


@pytest.mark.parametrize("host", ["10.0.0.7", "192.168.1.2", "::ffff:10.0.0.7", "2001:db8::1", "x"])
async def test_other_clients_are_refused(host: str) -> None:
    reloads: list[int] = []
    app = OperatorOnly(ReloadApp(lambda: reloads.append(1) or []))
    assert await call(app, (host, 5000)) == 403
    assert reloads == []


async def test_allowed_addresses_may_call_operator_routes() -> None:
    assert (
        await call(OperatorOnly(ReloadApp(lambda: []), allow=["10.0.0.7"]), ("10.0.0.7", 1)) == 200
    )


async def test_the_reload_route_says_what_refused_the_config() -> None:
    app = OperatorOnly(ReloadApp(lambda: ["canaries.x: no"]))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
        answer = await http.post("/switchyard/reload")
        assert answer.status_code == 422
        assert answer.json() == {"result": "rejected", "problems": ["canaries.x: no"]}
        assert (await http.get("/switchyard/reload")).status_code == 405


async def test_a_replaced_config_s_shadows_close_once_their_mirrors_end(tmp_path: Path) -> None:
    stack, _, _ = stack_for(tmp_path, config_text(extra="shadow = { var = 100.0 }\n"))
    old = stack.shadows
    assert old is not None
    assert stack.reload() == []
    assert stack.shadows is not None
    assert stack.shadows is not old
    for _ in range(10):
        await asyncio.sleep(0)
    assert old._http.is_closed
    assert not stack.shadows._http.is_closed
    await stack.aclose()
    assert stack.shadows._http.is_closed


async def test_lifespan_shutdown_closes_the_judge_pool_in_force_after_a_reload(
    tmp_path: Path,
) -> None:
    route = (
        '[routes.auto]\nclassifier = "llm"\njudge = "acct-b"\njudge_model = "other"\n'
        'choices = { x = "base" }\nfallback = "base"\n'
    )
    stack, _, _ = stack_for(tmp_path, config_text(extra=route))
    messages = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent: list[str] = []

    async def receive() -> dict[str, str]:
        if not messages:
            await asyncio.Event().wait()
        return messages.pop(0)

    async def send(message: dict[str, str]) -> None:
        sent.append(message["type"])

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await send({"type": "lifespan.startup.complete"})
        await receive()
        if stack.reload() != []:  # a reload while serving: the judge's pool changes hands
            raise AssertionError
        await send({"type": "lifespan.shutdown.complete"})

    stack.app = app
    pool = stack.judge.judge._http_client()
    await stack({"type": "lifespan"}, receive, send)  # type: ignore[arg-type]
    assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    assert stack.judge.judge.http is None or stack.judge.judge.http.is_closed
    assert pool.is_closed


@pytest.mark.parametrize("round_", range(20))
async def test_requests_racing_reloads_each_see_one_whole_config(
    tmp_path: Path, round_: int
) -> None:
    stack, _, path = stack_for(tmp_path, config_text(percent=0))
    texts = [config_text(percent=0), config_text(percent=100, a_name="acct-c")]
    whole = {"acct-a base", "acct-c var"}  # a mix would be "acct-a var" or "acct-c base"

    async def reloads() -> None:
        for i in range(10):
            path.write_text(texts[(i + round_) % 2])
            assert stack.reload() == []
            await asyncio.sleep(0)

    asked = [ask(stack, f"u{i}") for i in range(30)]
    *answers, _ = await asyncio.gather(*asked, reloads())
    assert {text for _, text, _ in answers} <= whole
