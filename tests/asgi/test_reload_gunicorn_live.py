"""Reloading under gunicorn with uvicorn workers, as docs/operations.md says to run it:
`gunicorn -k uvicorn.workers.UvicornWorker -w 2 examples.starlette_app:app`.

A SIGHUP to each worker's pid reloads that worker in place: same pids, the new config in
force, an account cooled before stays cooled, and a broken config is refused. A SIGHUP to
gunicorn's master starts new workers and stops the old ones gracefully: a stream in flight
ends whole, the new workers serve the new config, and (without Redis) the cooled account is
tried afresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import pytest

from reload_scenario import BROKEN, KEYS, LONG_REPLY, config_text, wait_for
from servers import ROOT, free_port, serve_in_thread, wait_for_port
from switchyard_mw.asgi.admin import config_digest
from switchyard_mw.config import parse_config
from switchyard_mw.testing import Behaviour, MockProvider

pytestmark = pytest.mark.integration
gunicorn_version = pytest.importorskip("gunicorn").version_info

WORKERS = 2
# gunicorn 27 opens a control socket at one path in the home directory: not for a test.
_NO_CONTROL_SOCKET = ["--no-control-socket"] if gunicorn_version >= (27,) else []


@contextlib.contextmanager
def gunicorn(config: Path, log: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """The example gateway under gunicorn with `WORKERS` uvicorn workers; its URL and master."""
    port = free_port()
    env = {
        **os.environ,
        **KEYS,
        "SWITCHYARD_CONFIG": str(config),
        "SWITCHYARD_START_MOCK": "0",
        "PYTHONWARNINGS": "ignore::DeprecationWarning",  # uvicorn.workers names its successor
    }
    command = [
        sys.executable,
        "-m",
        "gunicorn",
        "-k",
        "uvicorn.workers.UvicornWorker",
        "-w",
        str(WORKERS),
        "-b",
        f"127.0.0.1:{port}",
        "--graceful-timeout",
        "20",
        "--keep-alive",  # as docs/operations.md says: gunicorn's 2 s would be uvicorn's
        "75",
        *_NO_CONTROL_SOCKET,
        "examples.starlette_app:app",
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            try:
                wait_for_port(port, timeout=30)
            except TimeoutError:
                proc.kill()
                raise RuntimeError(log.read_text()) from None
            yield f"http://127.0.0.1:{port}", proc
        finally:
            proc.terminate()  # gunicorn's graceful stop of every worker
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def children(parent: int) -> set[int]:
    """The pids of `parent`'s child processes (gunicorn's workers are forked)."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (entry / "stat").read_text()
                if int(stat.rpartition(")")[2].split()[1]) == parent:
                    pids.add(int(entry.name))
    return pids


class Gateway:
    def __init__(self, url: str, config: Path, log: Path) -> None:
        self.config, self.log = config, log
        # No keep-alive: each request is a new connection, which any worker may accept.
        self.fresh = httpx.AsyncClient(
            base_url=url, limits=httpx.Limits(max_keepalive_connections=0), timeout=10
        )

    def count(self, text: str) -> int:
        return self.log.read_text(errors="replace").count(text)

    async def digests(self, workers: set[int]) -> dict[int, str]:
        """The config digest each worker reports, polled until each of `workers` answered."""
        seen: dict[int, str] = {}
        end = time.monotonic() + 30
        while not workers <= set(seen) and time.monotonic() < end:
            health = (await self.fresh.get("/switchyard/health")).json()
            seen[health["pid"]] = health["config"]
        return seen

    async def steady(self, stop: asyncio.Event) -> tuple[list[float], int]:
        """One request at a time until `stop`, each on a new connection: how long each took,
        and how many were reset before an answer and sent again. Any other failure fails the
        test.

        A worker that stops closes each connection it accepted but has not read a request
        from yet (uvicorn's shutdown: `Server.shutdown` closes a connection with no request
        in progress), so a request that reached it at that moment is reset unread (a
        `ReadError`, seen once in two full runs of the suite). The SDKs retry such a request;
        this client does too, once, and counts it."""
        waits, resets = [], 0
        while not stop.is_set():
            sent = time.monotonic()
            try:
                answer = await self.fresh.post("/v1/messages", json=_ASK_BASE, timeout=60)
            except (httpx.ReadError, httpx.RemoteProtocolError):
                resets += 1
                answer = await self.fresh.post("/v1/messages", json=_ASK_BASE, timeout=60)
            assert answer.status_code == 200, answer.text
            waits.append(time.monotonic() - sent)
            await asyncio.sleep(0.05)
        return waits, resets

    async def cool_answers(self, n: int) -> list[int]:
        """The statuses of `n` requests for the model of the account the mock fails (500)."""
        statuses = []
        for _ in range(n):
            answer = await self.fresh.post(
                "/v1/messages",
                json={
                    "model": "cool",
                    "max_tokens": 5,
                    "messages": [{"role": "user", "content": "x"}],
                },
            )
            statuses.append(answer.status_code)
        return statuses


_ASK_BASE = {"model": "base", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}


def digest(text: str) -> str:
    return config_digest(parse_config(text))


async def test_sighup_to_each_worker_and_to_the_master(tmp_path: Path) -> None:
    mock = MockProvider()
    mock.set_behaviour("key-slow", Behaviour(reply=LONG_REPLY, chunks=12, chunk_interval_secs=0.25))
    mock.set_behaviour("key-cool", Behaviour(status=500))
    config, log = tmp_path / "switchyard.toml", tmp_path / "gunicorn.log"
    with serve_in_thread(mock) as mock_url:
        config.write_text(config_text(mock_url, 0))
        with gunicorn(config, log) as (url, master):
            gw = Gateway(url, config, log)
            await wait_for(lambda: len(children(master.pid)) == WORKERS, "the workers")
            workers = children(master.pid)
            assert set(await gw.digests(workers)) == workers  # each answers on the port

            # Cool the `cool` account in both workers: each answers one 500, then 503s.
            fives: list[int] = []

            async def cooled_everywhere() -> bool:
                fives.extend(s for s in await gw.cool_answers(10) if s == 500)
                return len(fives) >= WORKERS

            await wait_for(cooled_everywhere, "the cool account cooled in both workers")
            assert len(fives) == WORKERS

            # A SIGHUP to each worker: reloaded in place.
            config.write_text(config_text(mock_url, 10))
            for pid in workers:
                os.kill(pid, signal.SIGHUP)
            await wait_for(lambda: gw.count("config reloaded") >= WORKERS, "two reloads logged")
            assert children(master.pid) == workers
            assert set((await gw.digests(workers)).values()) == {digest(config.read_text())}
            assert await gw.cool_answers(20) == [503] * 20  # health kept
            hits = sum(1 for r in mock.requests if r.key == "key-cool")
            assert hits == WORKERS

            # A broken config sent the same way: refused, nothing changes.
            good = config.read_text()
            config.write_text(good + BROKEN)
            for pid in workers:
                os.kill(pid, signal.SIGHUP)
            await wait_for(
                lambda: gw.count("config reload rejected") >= WORKERS, "two refusals logged"
            )
            assert children(master.pid) == workers
            assert set((await gw.digests(workers)).values()) == {digest(good)}

            # A SIGHUP to the master: new workers, the old ones stopped gracefully.
            sdk = anthropic.AsyncAnthropic(base_url=url, api_key="caller", max_retries=0)
            config.write_text(config_text(mock_url, 50))
            async with sdk.messages.stream(
                model="slow", max_tokens=64, messages=[{"role": "user", "content": "long"}]
            ) as long_stream:
                chunks = long_stream.text_stream
                first = await anext(chunks)
                os.kill(master.pid, signal.SIGHUP)
                stop = asyncio.Event()
                traffic = asyncio.create_task(gw.steady(stop))
                rest = [text async for text in chunks]
                final = await long_stream.get_final_message()
            assert (first + "".join(rest)).strip() == LONG_REPLY
            assert final.stop_reason == "end_turn"
            await wait_for(
                lambda: (
                    len(children(master.pid) - workers) == WORKERS
                    and not children(master.pid) & workers
                ),
                "new workers only",
            )
            await wait_for(lambda: gw.count("Application startup complete") >= 2 * WORKERS, "up")
            stop.set()
            waits, resets = await traffic
            # None refused or failed: while no worker is up, the master's socket holds them.
            # Each stopping worker resets at most the one request it had accepted unread.
            assert waits
            assert resets <= WORKERS
            assert max(waits) < 30
            fresh_workers = children(master.pid)
            assert set((await gw.digests(fresh_workers)).values()) == {digest(config.read_text())}
            # Health is forgotten (no Redis): each new worker tries the cooled account again.
            statuses = await gw.cool_answers(20)
            assert 1 <= statuses.count(500) <= WORKERS
            assert statuses.count(500) + statuses.count(503) == 20
            assert master.poll() is None
            await gw.fresh.aclose()


def test_an_idle_connection_outlives_gunicorns_keep_alive_default(tmp_path: Path) -> None:
    """Run as the docs say (`--keep-alive 75`), a connection idle for longer than gunicorn's
    2 s default (which uvicorn's worker would take as its own) still carries a request."""
    config, log = tmp_path / "switchyard.toml", tmp_path / "gunicorn.log"
    with serve_in_thread(MockProvider()) as mock_url:
        config.write_text(config_text(mock_url, 0))
        with gunicorn(config, log) as (url, _):
            port = int(url.rpartition(":")[2])
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            try:
                for pause in (0.0, 3.0):
                    time.sleep(pause)
                    connection.request("GET", "/switchyard/health")
                    answer = connection.getresponse()  # RemoteDisconnected had it closed
                    answer.read()
                    assert answer.status == 200
                    if pause == 0.0:
                        first = connection.sock
                assert connection.sock is first  # the same connection, not a new one
            finally:
                connection.close()
