"""A real `redis-server` for tests: a subprocess on a free loopback port, nothing on disk.

Tests skip when `redis-server` is not installed, unless SWITCHYARD_REQUIRE_REDIS=1 (set by
`.ci/run`, which installs it): there a missing server is a failure, not a silent skip.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from servers import free_port, wait_for_port


def redis_server_path() -> str:
    path = shutil.which("redis-server")
    if path is None:
        if os.environ.get("SWITCHYARD_REQUIRE_REDIS") == "1":
            pytest.fail("redis-server is not installed (SWITCHYARD_REQUIRE_REDIS=1)")
        pytest.skip("redis-server is not installed")
    return path


class RedisServer:
    """One `redis-server` process that a test may kill, pause and start again on its port."""

    def __init__(self, workdir: Path) -> None:
        self.binary = redis_server_path()
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        # No RDB, no AOF: a restart comes back empty, the worst case for a resync.
        command = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        command += ["--save", "", "--appendonly", "no", "--dir", str(self.workdir)]
        log = (self.workdir / "redis.log").open("ab")
        self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        wait_for_port(self.port)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def pause(self) -> None:
        """SIGSTOP: the port stays open but nothing answers (a slow, hung Redis)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)


def running_redis(workdir: Path) -> Iterator[RedisServer]:
    server = RedisServer(workdir)
    server.start()
    try:
        yield server
    finally:
        if server.proc is not None:
            server.resume()  # a stopped process would not die of SIGKILL until continued
        server.kill()


async def until(check: Callable[[], bool], within: float = 5.0) -> float:
    """Poll `check` every millisecond; the seconds it took to hold."""
    start = time.perf_counter()
    while not check():
        if time.perf_counter() - start > within:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.001)
    return time.perf_counter() - start
