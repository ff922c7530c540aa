"""Hedged first tokens: time to first token with and without hedging, and what it costs.

In process, through switchyard_stack: a scripted upstream app in place of the gateway's
forwarder, two accounts of one model whose first token comes after `BASE_SECS`: `a`, the
preferred one, answers 5 % of its requests (drawn at random, seeded) after ten times that, a
heavy tail; `b` (priority 1) never does.
`REQUESTS` JSON requests, `CONCURRENCY` at a time, twice: without hedging, then with
`hedge_after_secs = HEDGE_AFTER_SECS` on both accounts and the default budget
(`hedge_max_ratio = 0.05`, as large as the tail: the window's first 19 requests earn none),
then with a budget of 10 %. Printed: p50, p99 and max time to the answer's first byte as the
client sees it, the upstream calls made per request, and the hedges won, lost and refused.

    python bench/hedging.py
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import time

import httpx

from switchyard_mw.asgi._types import Receive, Scope, Send
from switchyard_mw.asgi.stack import switchyard_stack
from switchyard_mw.config import parse_config
from switchyard_mw.context import current_context

REQUESTS, CONCURRENCY = 600, 8
BASE_SECS, SLOW_SHARE, SLOW_FACTOR = 0.02, 0.05, 10
HEDGE_AFTER_SECS = 0.04
"""Twice the usual first token: well past it, far before a straggler's."""

ACCOUNT = """
[llm_clients.{name}]
base_url = "http://{name}.test"
api_key_env = "K"
models = ["m"]
priority = {priority}
failure_threshold = 1000
{hedge}
"""
BODY = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


class Upstream:
    """Answers after each account's drawn first-token time; counts the calls."""

    def __init__(self) -> None:
        self.draw = random.Random(1)  # `a`'s tail
        self.calls = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        await receive()
        ctx = current_context()
        assert ctx is not None
        assert ctx.account is not None
        self.calls += 1
        slow = ctx.account.name == "a" and self.draw.random() < SLOW_SHARE
        await asyncio.sleep(BASE_SECS * (SLOW_FACTOR if slow else 1))
        body = b'{"content":[{"type":"text","text":"ok"}]}'
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


async def run(hedge: bool, ratio: float = 0.05) -> dict[str, float]:
    line = f"hedge_after_secs = {HEDGE_AFTER_SECS}" if hedge else ""
    config = parse_config(
        f"[server]\nhedge_max_ratio = {ratio}\n"
        + ACCOUNT.format(name="a", priority=0, hedge=line)
        + ACCOUNT.format(name="b", priority=1, hedge=line)
    )
    upstream = Upstream()
    stack = switchyard_stack(upstream, config=config, environ={"K": "k"}, reload_on_signal=False)
    times: list[float] = []
    queue = list(range(REQUESTS))
    transport = httpx.ASGITransport(app=stack)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:

        async def worker() -> None:
            while queue:
                queue.pop()
                started = time.perf_counter()
                response = await client.post("/v1/messages", json=BODY)
                assert response.status_code == 200
                times.append(time.perf_counter() - started)

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    hedging = stack.engine.hedging
    hedges = 0 if hedging is None else hedging.counts("m")[1]
    await stack.aclose()
    ordered = sorted(times)
    return {
        "p50": statistics.median(ordered),
        "p95": ordered[int(0.95 * len(ordered)) - 1],
        "p99": ordered[int(0.99 * len(ordered)) - 1],
        "max": ordered[-1],
        "calls": upstream.calls / REQUESTS,
        "hedges": hedges,
    }


def main() -> None:
    print(
        f"{REQUESTS} requests, {CONCURRENCY} at a time; first token {BASE_SECS * 1000:.0f} ms, "
        f"{SLOW_SHARE:.0%} of account a's at {SLOW_FACTOR}x; hedge after "
        f"{HEDGE_AFTER_SECS * 1000:.0f} ms"
    )
    print("| | p50 ms | p95 ms | p99 ms | max ms | upstream calls / request | hedges started |")
    print("|---|---|---|---|---|---|---|")
    for hedge, ratio in ((False, 0.05), (True, 0.05), (True, 0.1)):
        r = asyncio.run(run(hedge, ratio))
        name = f"hedging, budget {ratio:.0%}" if hedge else "no hedging"
        print(
            f"| {name} | {r['p50'] * 1000:.1f} | "
            f"{r['p95'] * 1000:.1f} | {r['p99'] * 1000:.1f} | {r['max'] * 1000:.1f} | "
            f"{r['calls']:.3f} | {r['hedges']:.0f} |"
        )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
