"""`switchyard-mw serve CONFIG` in a subprocess, as an operator runs it: the start banner, its
log lines (JSON: every line parses, uvicorn's included), the records of a cooling and of the
recovery after it, a SIGHUP reload, and `--workers 2` reloading each worker on one SIGHUP.
The provider is the bundled mock, driven through its control API."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from servers import ROOT, free_port, serve_in_thread, wait_for_port, worker_pids
from switchyard_mw.testing import MockProvider

pytestmark = pytest.mark.integration

COOLDOWN_SECS = 1


def config_text(mock_url: str) -> str:
    return f"""
[llm_clients.a]
base_url = "{mock_url}"
api_key_env = "SERVE_KEY_A"
models = ["m"]
failure_threshold = 1
cooldown_secs = {COOLDOWN_SECS}

[llm_clients.b]
base_url = "{mock_url}"
api_key_env = "SERVE_KEY_B"
models = ["m"]
priority = 1
"""


@dataclass
class Served:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path
    config: Path

    def lines(self) -> list[str]:
        return self.log.read_text().splitlines()

    def records(self) -> list[dict[str, Any]]:
        """Every line of the log as JSON (fails on a line that is not)."""
        return [json.loads(line) for line in self.lines()]

    def wait_for(self, found: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if found():
                return
            time.sleep(0.05)
        pytest.fail(f"{what} not logged:\n{self.log.read_text()}")


@pytest.fixture(scope="module")
def mock_url() -> Iterator[str]:
    with serve_in_thread(MockProvider()) as url:
        yield url


@contextlib.contextmanager
def serve(tmp_path: Path, mock_url: str, *args: str, wait: bool = True) -> Iterator[Served]:
    """`switchyard-mw serve` on a free port; with `wait`, yielded once it listens."""
    config = tmp_path / "switchyard.toml"
    config.write_text(config_text(mock_url))
    port = free_port()
    env = {**os.environ, "SERVE_KEY_A": "key-a", "SERVE_KEY_B": "key-b"}
    env.pop("SWITCHYARD_CONFIG", None)
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "switchyard_mw.cli",
                "serve",
                str(config),
                "--port",
                str(port),
                *args,
            ],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    served = Served(proc, f"http://127.0.0.1:{port}", log, config)
    try:
        try:
            if wait:
                wait_for_port(port, timeout=30)
        except TimeoutError:
            proc.kill()
            raise RuntimeError(log.read_text()) from None
        yield served
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _ask(url: str, request_id: str | None = None) -> httpx.Response:
    headers = {"x-api-key": "client-key"}
    if request_id is not None:
        headers["x-request-id"] = request_id
    return httpx.post(
        f"{url}/v1/messages",
        headers=headers,
        json={"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
        timeout=10,
    )


def _events(served: Served, name: str) -> list[dict[str, Any]]:
    return [r for r in served.records() if r.get("event") == name]


def test_json_lines_banner_cooling_recovery_and_reload(tmp_path: Path, mock_url: str) -> None:
    with serve(tmp_path, mock_url, "--log-format", "json") as served:
        served.wait_for(
            lambda: any("Uvicorn running" in r["message"] for r in served.records()),
            "uvicorn's start line",
        )
        # The banner: the config, each account and its models, the state, the routes.
        start = _events(served, "serve.start")
        assert start[0]["message"] == "serving"
        assert start[0]["config"] == str(served.config.resolve())
        assert start[0]["url"] == served.url
        accounts = {r["account"]: r for r in start if r["message"] == "account"}
        assert set(accounts) == {"a", "b"}
        assert accounts["a"]["models"] == ["m"]
        assert accounts["a"]["base_url"] == mock_url
        state = next(r for r in start if r["message"] == "state")
        assert state["backend"] == "memory"
        routes = next(r for r in start if r["message"] == "routes")
        assert "POST /v1/messages" in routes["llm"]
        assert "GET /metrics" in routes["operator"]

        # Account a's key fails: one fault cools it (threshold 1), b answers the same request.
        httpx.put(f"{mock_url}/_mock/behaviours/key-a", json={"status": 503}).raise_for_status()
        try:
            # The client names its request: the records name it so.
            answer = _ask(served.url, request_id="client-req-01")
            assert answer.status_code == 200
            assert answer.headers["x-switchyard-account"] == "b"
            served.wait_for(lambda: _events(served, "account.cooled"), "the cooling")
        finally:
            httpx.delete(f"{mock_url}/_mock/behaviours/key-a").raise_for_status()
        (cooled,) = _events(served, "account.cooled")
        assert cooled["level"] == "WARNING"
        assert cooled["logger"] == "switchyard_mw.accounts"
        assert cooled["account"] == "a"
        assert cooled["cause"] == "outage"
        assert cooled["status"] == "503"
        assert cooled["period_secs"] == COOLDOWN_SECS
        assert cooled["request_id"] == "client-req-01"

        # The cooling over, the next request is a's probe: it succeeds, a is back.
        time.sleep(COOLDOWN_SECS + 0.2)
        answer = _ask(served.url)
        assert answer.headers["x-switchyard-account"] == "a"
        served.wait_for(lambda: _events(served, "account.recovered"), "the recovery")
        (back,) = _events(served, "account.recovered")
        assert (back["level"], back["account"], back["probe"]) == ("INFO", "a", "succeeded")
        assert len(back["request_id"]) == 16  # no x-request-id: one made for it

        # uvicorn's access lines are JSON too, with their parts as fields.
        access = [r for r in served.records() if r["logger"] == "uvicorn.access"]
        assert {(r["method"], r["path"], r["status"]) for r in access} == {
            ("POST", "/v1/messages", 200)
        }

        # SIGHUP reloads the config in place, logged; a broken config is refused, logged.
        served.proc.send_signal(signal.SIGHUP)
        served.wait_for(lambda: _events(served, "config.reload"), "the reload")
        served.config.write_text(config_text(mock_url) + "cooldown_secs = 0\n")
        served.proc.send_signal(signal.SIGHUP)
        served.wait_for(lambda: len(_events(served, "config.reload")) == 2, "the refusal")
        ok, refused = _events(served, "config.reload")
        assert (ok["level"], ok["result"]) == ("WARNING", "ok")
        assert (refused["level"], refused["result"]) == ("ERROR", "rejected")
        assert any("cooldown_secs" in problem for problem in refused["problems"])

    # A graceful stop (uvicorn raises SIGTERM again once it has stopped, as its own command
    # does), every line of the log JSON.
    assert served.proc.returncode == -signal.SIGTERM
    messages = [r["message"] for r in served.records()]
    assert "Shutting down" in messages
    assert "Finished server process" in " ".join(messages)


def _catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process `pid` has a handler for `sig` (Linux: /proc/PID/status, SigCgt)."""
    with contextlib.suppress(FileNotFoundError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
@pytest.mark.parametrize("workers", [1, 2])
def test_a_sighup_while_it_loads_does_not_end_it(
    tmp_path: Path, mock_url: str, workers: int
) -> None:
    """SIGHUPs from the moment the process handles one (long before the app has loaded) until
    every worker serves: none ends (no worker is replaced), and each reads its config again
    once it serves."""
    args = ("--log-format", "json", "--workers", str(workers))
    with serve(tmp_path, mock_url, *args, wait=False) as served:
        pid = served.proc.pid
        end = time.monotonic() + 60
        while not _catches(pid, signal.SIGHUP) and time.monotonic() < end:
            assert served.proc.poll() is None, served.log.read_text()
            time.sleep(0.005)
        served.proc.send_signal(signal.SIGHUP)
        assert "serve.start" not in served.log.read_text()  # before the app, even the banner
        sent = 1

        def started() -> int:
            return served.log.read_text().count("Application startup complete")

        while served.proc.poll() is None and started() < workers and time.monotonic() < end:
            served.proc.send_signal(signal.SIGHUP)
            sent += 1
            time.sleep(0.05)
        assert served.proc.poll() is None, served.log.read_text()
        assert sent > 1  # some came while it loaded
        assert _ask(served.url).status_code == 200
        served.wait_for(
            lambda: len(_events(served, "config.reload")) >= workers, "a reload in each worker"
        )
        assert all(r["result"] == "ok" for r in _events(served, "config.reload"))
        assert started() == workers
        assert "died" not in served.log.read_text()  # uvicorn's word for a worker it replaced


def test_text_banner(tmp_path: Path, mock_url: str) -> None:
    with serve(tmp_path, mock_url, "--no-access-log") as served:
        served.wait_for(
            lambda: any("Uvicorn running" in line for line in served.lines()), "the start line"
        )
        _ask(served.url)
    lines = served.lines()
    config = served.config.resolve()
    serving = next(line for line in lines if " switchyard_mw.serve serving " in line)
    assert f"config={config} url={served.url} workers=1" in serving
    assert any(" account account=a base_url=" in line and 'models=["m"]' in line for line in lines)
    assert any(" state backend=memory" in line for line in lines)
    assert not any("uvicorn.access" in line for line in lines)  # --no-access-log
    for line in lines:  # time, level, logger first on every line
        stamp, level, logger, _ = line.split(" ", 3)
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", stamp)
        assert level in {"INFO", "WARNING", "ERROR"}
        assert logger.startswith(("switchyard_mw", "uvicorn"))


def test_two_workers_each_reload_on_one_sighup(tmp_path: Path, mock_url: str) -> None:
    with serve(tmp_path, mock_url, "--workers", "2", "--log-format", "json") as served:
        served.wait_for(lambda: len(worker_pids(served.proc.pid)) == 2, "two workers", 30)
        served.wait_for(
            lambda: (
                sum("Application startup complete" in r["message"] for r in served.records()) == 2
            ),
            "both workers' start",
            30,
        )
        workers = worker_pids(served.proc.pid)
        assert _ask(served.url).status_code == 200
        served.proc.send_signal(signal.SIGHUP)
        served.wait_for(lambda: len(_events(served, "config.reload")) == 2, "two reloads")
        # Reloaded in place: the same workers serve on.
        assert worker_pids(served.proc.pid) == workers
        assert _ask(served.url).status_code == 200
        (passed,) = _events(served, "serve.reload")
        assert passed["workers"] == 2
        state = next(r for r in _events(served, "serve.start") if r["message"] == "state")
        assert state["shared"].startswith("no")  # memory: each worker cools on its own


def test_a_stop_lets_a_stream_under_way_end_whole(tmp_path: Path, mock_url: str) -> None:
    """SIGTERM while a stream runs: the server stops taking connections, the stream goes on to
    its last event (within --graceful-secs), then the process ends."""
    httpx.put(
        f"{mock_url}/_mock/behaviours/key-a", json={"chunks": 6, "chunk_interval_secs": 0.3}
    ).raise_for_status()
    try:
        with serve(tmp_path, mock_url, "--graceful-secs", "20") as served:
            body = {
                "model": "m",
                "max_tokens": 8,
                "stream": True,
                "messages": [{"role": "user", "content": "hi"}],
            }
            events = []
            with httpx.stream(
                "POST",
                f"{served.url}/v1/messages",
                headers={"x-api-key": "client-key"},
                json=body,
                timeout=30,
            ) as answer:
                assert answer.status_code == 200
                for line in answer.iter_lines():
                    if line.startswith("event: ") and not events:
                        served.proc.send_signal(signal.SIGTERM)  # once the stream started
                    if line.startswith("event: "):
                        events.append(line.removeprefix("event: "))
            assert events[-1] == "message_stop"
            assert events.count("content_block_delta") == 6
            served.proc.wait(20)
        log = served.log.read_text()
        assert "Shutting down" in log
        assert "Cancel" not in log  # uvicorn says so when it cuts a request at the timeout
    finally:
        httpx.delete(f"{mock_url}/_mock/behaviours/key-a").raise_for_status()


def test_an_invalid_config_is_exit_2_and_serves_nothing(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(
        '[llm_clients.a]\nbase_url = "http://x"\nmodels = ["m"]\ncooldown_secs = 0\n'
        'api_key_env = "SERVE_UNSET_KEY"\n'
    )
    done = subprocess.run(
        [sys.executable, "-m", "switchyard_mw.cli", "serve", str(config), "--port", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    # As check-config says them: each problem at its line, the unset key variable too.
    assert f"{config}:4: llm_clients.a.cooldown_secs: must be > 0" in done.stderr
    assert "llm_clients.a.api_key_env: environment variable SERVE_UNSET_KEY is not set" in (
        done.stderr
    )
    assert "Uvicorn running" not in done.stderr


def readme_serve_commands() -> list[str]:
    """The `switchyard-mw` commands of the README's "Start here", in order."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Start here\n", 1)[1].split("\n## ", 1)[0]
    lines = []
    for block in re.findall(r"```sh\n(.*?)```", section, re.S):
        lines += [line.strip() for line in block.splitlines()]
    return [line for line in lines if line.startswith(".venv/bin/switchyard-mw ")]


def test_the_readme_commands_as_written(tmp_path: Path, mock_url: str) -> None:
    """Check, then serve `my.toml` as the README says (this virtualenv's program, the port
    moved): two workers answer, the log is JSON."""
    check, serve_command = readme_serve_commands()
    (tmp_path / "my.toml").write_text(config_text(mock_url))
    port = free_port()
    env = {**os.environ, "SERVE_KEY_A": "key-a", "SERVE_KEY_B": "key-b"}

    def as_run(command: str) -> list[str]:
        command = command.replace(".venv/bin/", f"{Path(sys.executable).parent}/")
        return ["bash", "-c", "exec " + command.replace("--port 8002", f"--port {port}")]

    checked = subprocess.run(
        as_run(check), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.startswith("OK my.toml")
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            as_run(serve_command), cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT
        )
    served = Served(proc, f"http://127.0.0.1:{port}", log, tmp_path / "my.toml")
    try:
        wait_for_port(port, timeout=30)
        served.wait_for(lambda: len(worker_pids(proc.pid)) == 2, "two workers", 30)
        assert _ask(served.url).status_code == 200
        (start,) = [r for r in _events(served, "serve.start") if r["message"] == "serving"]
        assert (start["workers"], start["url"]) == (2, served.url)
    finally:
        proc.terminate()
        proc.wait(20)
