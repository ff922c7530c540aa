"""The hedge's race through the stack, in process: an app scripted per account, tens of ms.

`a` (preferred) and `b` serve `m`; `a` hedges after `AFTER_SECS`. Each row scripts how each
account's run goes (a wait, then an answer, an error answer or a transport error) and checks
what the client got, which account answered, what each account was charged and what
`switchyard.hedges` counted. The live test (`test_hedge_live.py`) covers the wire and the SDKs.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import httpx
import pytest

from conftest import Metrics
from switchyard_mw import switchyard_stack
from switchyard_mw.asgi._types import Receive, Scope, Send
from switchyard_mw.config import parse_config
from switchyard_mw.context import current_context
from switchyard_mw.core.breaker import BreakerState
from switchyard_mw.telemetry import names as tm

AFTER_SECS = 0.05
CONFIG = f"""
[server]
hedge_max_ratio = 1.0

[llm_clients.a]
base_url = "http://a.test"
api_key_env = "K"
models = ["m"]
failure_threshold = 1
timeout_secs = 2
hedge_after_secs = {AFTER_SECS}

[llm_clients.b]
base_url = "http://b.test"
api_key_env = "K"
models = ["m"]
priority = 1
failure_threshold = 1
timeout_secs = 2
"""
BODY = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


@dataclass(frozen=True)
class Run:
    wait: float
    """Seconds before the answer starts."""
    status: int = 200
    raises: bool = False
    """A transport error in place of an answer."""


class Upstream:
    """The app: each account's run as scripted; records who was called and who finished."""

    def __init__(self, script: dict[str, Run]) -> None:
        self.script = script
        self.called: list[str] = []
        self.finished: list[str] = []
        self.cancelled: list[str] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        await receive()
        ctx = current_context()
        assert ctx is not None
        assert ctx.account is not None
        assert scope["state"]["switchyard"] is ctx  # `request.state.switchyard` alike
        name = ctx.account.name
        self.called.append(name)
        run = self.script[name]
        try:
            await asyncio.sleep(run.wait)
        except asyncio.CancelledError:
            self.cancelled.append(name)
            raise
        if run.raises:
            ctx.report_transport_error(httpx.ConnectError("refused"))
            raise httpx.ConnectError("refused")
        body = json.dumps({"content": [{"type": "text", "text": f"from {name}"}]}).encode()
        if run.status != 200:
            body = json.dumps({"type": "error", "error": {"type": "api_error"}}).encode()
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": run.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        self.finished.append(name)


@dataclass(frozen=True)
class Row:
    script: dict[str, Run]
    answer: str
    """The account whose answer the client got."""
    charged: dict[str, int]
    """Faults counted per account."""
    result: str
    cancelled: tuple[str, ...] = ()
    finished: tuple[str, ...] = ()
    """Who sent a whole answer besides the winner (one that failed: its error answer)."""


ROWS = {
    "the hedge answers first, the first is cancelled": Row(
        {"a": Run(1.0), "b": Run(0.0)}, "b", {"a": 0, "b": 0}, "won", ("a",)
    ),
    "the first answers before the hedge answers: the hedge is cancelled": Row(
        {"a": Run(0.1), "b": Run(1.0)}, "a", {"a": 0, "b": 0}, "lost", ("b",)
    ),
    "the first fails before content: the hedge goes on": Row(
        {"a": Run(0.1, status=503), "b": Run(0.3)}, "b", {"a": 1, "b": 0}, "won", (), ("a",)
    ),
    "the hedge fails in transport: the first goes on": Row(
        {"a": Run(0.3), "b": Run(0.05, raises=True)}, "a", {"a": 0, "b": 1}, "lost"
    ),
}


@pytest.mark.parametrize("row", ROWS.values(), ids=ROWS.keys())
async def test_the_race(row: Row, otel_metrics: Metrics) -> None:
    upstream = Upstream(row.script)
    stack = switchyard_stack(
        upstream, config=parse_config(CONFIG), environ={"K": "k"}, reload_on_signal=False
    )
    before = otel_metrics.value(tm.HEDGES, **{tm.RESPONSE_MODEL: "m", "result": row.result})
    transport = httpx.ASGITransport(app=stack)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        response = await client.post("/v1/messages", json=BODY)
    assert response.status_code == 200
    assert response.json()["content"][0]["text"] == f"from {row.answer}"
    assert response.headers["x-switchyard-account"] == row.answer
    assert response.headers["x-switchyard-attempts"] == "2"
    assert sorted(upstream.called) == ["a", "b"]
    assert upstream.finished == [*row.finished, row.answer]
    assert tuple(upstream.cancelled) == row.cancelled
    for name, faults in row.charged.items():
        status = stack.pool.status_of(name)
        expected = BreakerState.COOLED if faults else BreakerState.CLOSED
        assert (status.state, status.consecutive_faults) == (expected, faults), name
    after = otel_metrics.value(tm.HEDGES, **{tm.RESPONSE_MODEL: "m", "result": row.result})
    assert after == before + 1
    await stack.aclose()


async def test_an_answer_before_the_hedge_time_races_nothing(otel_metrics: Metrics) -> None:
    upstream = Upstream({"a": Run(0.0), "b": Run(0.0)})
    stack = switchyard_stack(
        upstream, config=parse_config(CONFIG), environ={"K": "k"}, reload_on_signal=False
    )
    transport = httpx.ASGITransport(app=stack)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        response = await client.post("/v1/messages", json=BODY)
    assert response.headers["x-switchyard-account"] == "a"
    assert response.headers["x-switchyard-attempts"] == "1"
    assert upstream.called == ["a"]
    await stack.aclose()


async def test_a_deadline_mid_race_ends_both_and_charges_the_first_only() -> None:
    """Neither answers within `a`'s deadline: the 504 is `a`'s fault; the hedge was cancelled
    with the attempt and goes back with no outcome."""
    upstream = Upstream({"a": Run(5.0), "b": Run(5.0)})
    config = parse_config(
        CONFIG.replace("timeout_secs = 2\nhedge_after", "timeout_secs = 0.3\nhedge_after")
    )
    assert config.llm_clients["a"].timeout_secs == 0.3
    stack = switchyard_stack(upstream, config=config, environ={"K": "k"}, reload_on_signal=False)
    transport = httpx.ASGITransport(app=stack)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        response = await client.post("/v1/messages", json=BODY)
    assert response.status_code == 504
    assert sorted(upstream.cancelled) == ["a", "b"]
    assert upstream.finished == []
    a, b = stack.pool.status_of("a"), stack.pool.status_of("b")
    assert (a.state, a.consecutive_faults) == (BreakerState.COOLED, 1)
    assert (b.state, b.consecutive_faults) == (BreakerState.CLOSED, 0)
    await stack.aclose()
