"""examples/wrap_your_app.py as the README runs it: its two commands as written (ports moved),
`switchyard-mw mock` in one process, `uvicorn examples.wrap_your_app:app` in another, then the
official SDKs as clients.

What a team copying the file relies on: its forwarding route answers and streams through the
stack (both wires), an account that refuses is failed over, a model no account serves gets
the app's own 404, a plain route passes untouched, /metrics and /switchyard/accounts answer,
and Ctrl-C stops it cleanly.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from servers import ROOT, free_port, wait_for_port

pytestmark = pytest.mark.integration

KEYS = {"MOCK_KEY_A": "key-a", "MOCK_KEY_B": "key-b", "MOCK_JUDGE_KEY": "key-j"}
HELLO = [{"role": "user", "content": "Hello"}]


@dataclass
class Running:
    app: subprocess.Popen[bytes]
    url: str
    mock_url: str
    log: Path


def _stop(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


def readme_commands() -> list[str]:
    """The shell commands of the README's "Wrap your own app", in order: the mock it starts
    when "Start here" is not running (given in a comment), then the app."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Wrap your own app\n", 1)[1].split("\n## ", 1)[0]
    block = re.findall(r"```sh\n(.*?)```", section, re.S)[0]
    mock = re.search(r"\.venv/bin/switchyard-mw mock --port \d+ &", block)
    assert mock is not None, block
    lines = [line.strip() for line in block.splitlines()]
    return [mock.group(), *(line for line in lines if line and not line.startswith("#"))]


def _as_run(command: str, *, port: int, mock_port: int) -> list[str]:
    """A README command for a shell: this virtualenv's programs, the ports moved, in the
    foreground (exec: the process started is the program itself, which a signal reaches)."""
    command = command.replace(".venv/bin/", f"{Path(sys.executable).parent}/")
    command = command.replace("--port 9100", f"--port {mock_port}")
    command = command.replace("--port 8001", f"--port {port}")
    assert str(port) in command or str(mock_port) in command, command
    words = command.removesuffix("&").split()
    assignments = [w for w in words if re.fullmatch(r"[A-Z_]+=\S*", w)]  # leading VAR=value
    program = words[len(assignments) :]
    return ["bash", "-c", " ".join([*assignments, "exec", *program])]


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    tmp = tmp_path_factory.mktemp("wrap")
    port, mock_port = free_port(), free_port()
    # The example's config with its accounts moved to the mock's free port.
    config = tmp / "switchyard.toml"
    text = (ROOT / "examples" / "switchyard.toml").read_text()
    config.write_text(text.replace("127.0.0.1:9100", f"127.0.0.1:{mock_port}"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SWITCHYARD_", "MOCK_"))}
    env["SWITCHYARD_CONFIG"] = str(config)
    log = tmp / "app.log"
    start_mock, start_app = readme_commands()
    assert start_mock.startswith(".venv/bin/switchyard-mw mock ")
    assert all(f"{k}={v}" in start_app for k, v in KEYS.items())  # the README's keys
    with (tmp / "mock.log").open("wb") as out:
        mock = subprocess.Popen(
            _as_run(start_mock, port=port, mock_port=mock_port),
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    with log.open("wb") as out:
        app = subprocess.Popen(
            _as_run(start_app, port=port, mock_port=mock_port),
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        try:
            wait_for_port(mock_port)
            wait_for_port(port)
        except TimeoutError:
            raise RuntimeError(log.read_text()) from None
        yield Running(app, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{mock_port}", log)
    finally:
        for proc in (app, mock):
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


def _behave(running: Running, key: str, behaviour: dict[str, object]) -> None:
    r = httpx.put(f"{running.mock_url}/_mock/behaviours/{key}", json=behaviour, timeout=5)
    assert r.status_code == 200, r.text


def test_the_wrapped_app_answers_streams_fails_over_and_stops(running: Running) -> None:
    claude = anthropic.Anthropic(base_url=running.url, api_key="anything", max_retries=0)
    gpt = openai.OpenAI(base_url=f"{running.url}/v1", api_key="anything", max_retries=0)

    # A plain answer: the stack chose the account and said so.
    raw = claude.messages.with_raw_response.create(
        model="claude-haiku-5", max_tokens=100, messages=HELLO
    )
    assert raw.headers["x-switchyard-account"] == "mock-a"
    assert raw.headers["x-switchyard-model"] == raw.parse().model == "claude-haiku-5"
    assert raw.parse().content[0].text == "Hello from the mock provider."  # type: ignore[union-attr]

    # Streams on both wires, relayed chunk by chunk to the end.
    with claude.messages.stream(model="claude-haiku-5", max_tokens=100, messages=HELLO) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == "Hello from the mock provider."
    assert final.stop_reason == "end_turn"
    chunks = gpt.chat.completions.create(model="gpt-5", messages=HELLO, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == "Hello from the mock provider."

    # Key A refuses: the same request is answered by key B in the same call, a stream too.
    _behave(running, KEYS["MOCK_KEY_A"], {"status": 401})
    raw = claude.messages.with_raw_response.create(
        model="claude-haiku-5", max_tokens=100, messages=HELLO
    )
    assert (raw.headers["x-switchyard-account"], raw.headers["x-switchyard-attempts"]) == (
        "mock-b",
        "2",
    )
    with claude.messages.stream(model="claude-haiku-5", max_tokens=100, messages=HELLO) as s:
        assert "".join(s.text_stream) == "Hello from the mock provider."

    # A model no account serves reaches the app, which answers its own 404.
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="no-such-model", max_tokens=10, messages=HELLO)
    assert httpx.get(f"{running.url}/hello").json() == {"hello": "world"}

    # The operator routes: metrics, and key A's faults on its account.
    metrics = httpx.get(f"{running.url}/metrics")
    assert metrics.status_code == 200
    faults = [
        line
        for line in metrics.text.splitlines()
        if line.startswith("switchyard_account_faults_total{")
        and 'switchyard_account="mock-a"' in line
        and 'status="401"' in line
    ]
    assert len(faults) == 1, metrics.text
    assert float(faults[0].rsplit(" ", 1)[1]) == 2  # the two refused calls above
    accounts = httpx.get(f"{running.url}/switchyard/accounts").json()["accounts"]
    assert {a["name"] for a in accounts} == {"mock-a", "mock-b", "mock-cloud", "mock-judge"}

    assert _stop(running.app) == 0
    assert "Traceback" not in running.log.read_text(), running.log.read_text()
