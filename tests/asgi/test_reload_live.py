"""A canary ramp by reload under `uvicorn examples.starlette_app:app --workers 2`, with traffic.

The official SDKs keep sending requests (no retries) while the canary goes 0 -> 10 -> 50 % by
SIGHUP to each worker's pid: none fails, a long stream that spans a reload ends whole, the
share of conversations on the variant follows each percentage, every conversation already on
the variant stays there, and an account cooled before the reloads stays cooled (no request
reaches it). Then a broken config sent the same way changes nothing but the `rejected` count
and the log.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from reload_scenario import (
    BROKEN,
    KEYS,
    LONG_REPLY,
    USERS,
    config_text,
    placements,
    share_bounds,
    steady,
    wait_for,
)
from servers import example_gateway_process, serve_in_thread, worker_pids
from switchyard_mw.asgi.admin import config_digest
from switchyard_mw.config import parse_config
from switchyard_mw.testing import Behaviour, MockProvider

pytestmark = pytest.mark.integration


def mock_behaviours(mock: MockProvider) -> None:
    mock.set_behaviour("key-slow", Behaviour(reply=LONG_REPLY, chunks=12, chunk_interval_secs=0.25))
    mock.set_behaviour("key-cool", Behaviour(status=500))


class Gateway:
    def __init__(self, url: str, pid: int, tmp_path: Path, mock_url: str) -> None:
        self.url, self.pid, self.mock_url = url, pid, mock_url
        self.config = tmp_path / "switchyard.toml"
        self.log = tmp_path / "gateway.log"
        # No keep-alive: each request is a new connection, which any worker may accept.
        self.fresh = httpx.AsyncClient(
            base_url=url, limits=httpx.Limits(max_keepalive_connections=0), timeout=10
        )
        self.workers = worker_pids(pid)

    def log_count(self, text: str) -> int:
        return self.log.read_text(errors="replace").count(text)

    async def reload(self, text: str, *, expect: str) -> None:
        """Write `text` as the config, SIGHUP each worker, wait until each has logged `expect`."""
        before = self.log_count(expect)
        self.config.write_text(text)
        for pid in self.workers:
            os.kill(pid, signal.SIGHUP)
        want = before + len(self.workers)
        await wait_for(lambda: self.log_count(expect) >= want, f"{want} x {expect!r}")

    async def digests(self) -> dict[int, str]:
        """The config digest each worker reports, polled until every worker answered."""
        seen: dict[int, str] = {}
        end = time.monotonic() + 30
        while set(seen) != set(self.workers) and time.monotonic() < end:
            health = (await self.fresh.get("/switchyard/health")).json()
            seen[health["pid"]] = health["config"]
        return seen

    async def metric(self, name: str, **labels: str) -> float:
        text = (await self.fresh.get("/metrics")).text
        total = 0.0
        for line in text.splitlines():
            series, _, value = line.rpartition(" ")
            if series.startswith(name) and all(f'{k}="{v}"' in series for k, v in labels.items()):
                total += float(value)
        return total


async def cooled_hits(gw: Gateway, mock: MockProvider) -> tuple[int, int]:
    """(answers of 500, of 503) to 20 requests for the cooled account's model."""
    statuses = []
    for _ in range(20):
        answer = await gw.fresh.post(
            "/v1/messages",
            json={"model": "cool", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]},
        )
        statuses.append(answer.status_code)
    return statuses.count(500), statuses.count(503)


async def test_a_canary_ramp_by_sighup_to_each_worker(tmp_path: Path) -> None:
    mock = MockProvider()
    mock_behaviours(mock)
    with (
        serve_in_thread(mock) as mock_url,
        example_gateway_process(config_text(mock_url, 0), tmp_path, KEYS, workers=2) as (url, proc),
    ):
        gw = Gateway(url, proc.pid, tmp_path, mock_url)
        await wait_for(lambda: len(worker_pids(proc.pid)) == 2, "two workers")
        gw.workers = worker_pids(proc.pid)
        await run_ramp(gw, mock)
        await gw.fresh.aclose()


async def run_ramp(gw: Gateway, mock: MockProvider) -> None:
    sdk = anthropic.AsyncAnthropic(base_url=gw.url, api_key="caller", max_retries=0)
    oai = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="caller", max_retries=0)
    # Cool the `cool` account in both workers: each answers one 500, then 503s.
    fives: list[int] = []

    async def cooled_everywhere() -> bool:
        fives.append((await cooled_hits(gw, mock))[0])
        return sum(fives) >= 2

    await wait_for(cooled_everywhere, "the cool account cooled in both workers")
    assert sum(fives) == 2
    at_0 = await placements(sdk, USERS)
    assert set(at_0.values()) == {"base"}

    stop, done = asyncio.Event(), []
    traffic = [asyncio.create_task(steady(oai, stop, done)) for _ in range(3)]
    # A long stream (3 s) that spans the first reload.
    async with sdk.messages.stream(
        model="slow", max_tokens=64, messages=[{"role": "user", "content": "long"}]
    ) as long_stream:
        chunks = long_stream.text_stream
        first = await anext(chunks)
        await gw.reload(config_text(gw.mock_url, 10), expect="config reloaded")
        rest = [text async for text in chunks]
        final = await long_stream.get_final_message()
    assert (first + "".join(rest)).strip() == LONG_REPLY
    assert final.stop_reason == "end_turn"

    assert set((await gw.digests()).values()) == {
        config_digest(parse_config(config_text(gw.mock_url, 10)))
    }
    at_10 = await placements(sdk, USERS)
    on_10 = {u for u, m in at_10.items() if m == "var"}
    low, high = share_bounds(10, len(USERS))
    assert low <= len(on_10) <= high

    await gw.reload(config_text(gw.mock_url, 50), expect="config reloaded")
    at_50 = await placements(sdk, USERS)
    on_50 = {u for u, m in at_50.items() if m == "var"}
    low, high = share_bounds(50, len(USERS))
    assert low <= len(on_50) <= high
    assert on_10 <= on_50  # a monotone ramp: nobody on the variant went back

    stop.set()
    await asyncio.gather(*traffic)  # any failed request raises here
    assert len(done) > 20
    assert set(done) <= {"base", "var"}

    # The cooled account stayed cooled through both reloads: no request reached it again.
    assert await cooled_hits(gw, mock) == (0, 20)
    assert sum(1 for r in mock.requests if r.key == "key-cool") == 2

    # A broken config: refused by each worker; nothing else changes.
    digest = config_digest(parse_config(config_text(gw.mock_url, 50)))
    await gw.reload(config_text(gw.mock_url, 50) + BROKEN, expect="config reload rejected")
    assert gw.log_count("canaries.nobody.variants") >= 2
    assert set((await gw.digests()).values()) == {digest}
    for _ in range(4):  # whichever worker answers
        assert await gw.metric("switchyard_config_reloads_total", result="rejected") == 1
        assert await gw.metric("switchyard_config_reloads_total", result="ok") == 2
    sample = USERS[:60]
    assert await placements(sdk, sample) == {u: at_50[u] for u in sample}
    assert await cooled_hits(gw, mock) == (0, 20)
    assert proc_alive(gw)


def proc_alive(gw: Gateway) -> bool:
    return worker_pids(gw.pid) == gw.workers


async def test_one_uvicorn_process_reloads_on_sighup_and_on_the_reload_route(
    tmp_path: Path,
) -> None:
    with example_gateway_process(config_text("http://127.0.0.1:9", 0), tmp_path, KEYS) as (
        url,
        proc,
    ):
        config = tmp_path / "switchyard.toml"
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:

            async def digest() -> str:
                answer: str = (await http.get("/switchyard/health")).json()["config"]
                return answer

            config.write_text(config_text("http://127.0.0.1:9", 10))
            os.kill(proc.pid, signal.SIGHUP)  # without a handler, this would end the process
            want = config_digest(parse_config(config.read_text()))
            await wait_for(lambda: _equal(digest(), want), "the SIGHUP reload")
            assert proc.poll() is None

            config.write_text(config_text("http://127.0.0.1:9", 20))
            answer = await http.post("/switchyard/reload")
            assert (answer.status_code, answer.json()) == (200, {"result": "ok"})
            canaries = (await http.get("/switchyard/canaries")).json()["canaries"]
            assert canaries[0]["variants"] == {"var": 20.0}

            config.write_text(config_text("http://127.0.0.1:9", 20) + BROKEN)
            answer = await http.post("/switchyard/reload")
            assert answer.status_code == 422
            assert (
                "canaries.nobody.variants.var: must be between 0 and 100"
                in answer.json()["problems"]
            )
            assert await digest() == config_digest(
                parse_config(config_text("http://127.0.0.1:9", 20))
            )


async def _equal(value: Awaitable[str], want: str) -> bool:
    return await value == want
