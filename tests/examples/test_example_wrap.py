"""examples/wrap_your_app.py as the README runs it: its two commands as written (ports moved),
`switchyard-mw mock` in one process, `uvicorn examples.wrap_your_app:app` in another, then the
official SDKs as clients.

What a team copying the file relies on: its forwarding route answers and streams through the
stack (both wires), an account that refuses is failed over, a model no account serves gets
the app's own 404, a plain route passes untouched, /metrics and /switchyard/accounts answer,
and Ctrl-C stops it cleanly.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import anthropic
import httpx
import openai
import pytest
from openai.types.responses import ResponseErrorEvent, ResponseTextDeltaEvent

from node_clients import AiSdk, Call
from servers import ROOT, free_port, wait_for_port

pytestmark = pytest.mark.integration

KEYS = {"MOCK_KEY_A": "key-a", "MOCK_KEY_B": "key-b", "MOCK_JUDGE_KEY": "key-j"}
HELLO: Any = [{"role": "user", "content": "Hello"}]
WIRES = ("anthropic", "chat", "responses")


@pytest.fixture(scope="module")
def ai_sdk(tmp_path_factory: pytest.TempPathFactory) -> AiSdk:
    """The Vercel AI SDK under Node (installed before the app starts)."""
    return AiSdk(tmp_path_factory.mktemp("ai-sdk"))


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
    with started(tmp_path_factory.mktemp("wrap")) as app:
        yield app


@pytest.fixture
def fresh(tmp_path: Path) -> Iterator[Running]:
    """Another run of the README's commands: no account health carried over."""
    with started(tmp_path) as app:
        yield app


@contextlib.contextmanager
def started(tmp: Path) -> Iterator[Running]:
    """The mock and the app started as the README's commands say, in `tmp`."""
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


def _read(events: Any, into: list[Any]) -> None:
    """Append what a stream yields, keeping what arrived before it raises."""
    for event in events:
        into.append(event)


class Read(NamedTuple):
    """What a client read of a stream: its text, and the type (Responses: code) and message
    of the error it reported (None: the stream ended whole)."""

    text: str
    kind: str | None = None
    message: str | None = None


def _messages_stream(claude: anthropic.Anthropic) -> Read:
    events: list[Any] = []
    stream = claude.messages.create(
        model="claude-haiku-5", max_tokens=100, messages=HELLO, stream=True
    )
    try:
        _read(stream, events)
    except anthropic.APIStatusError as exc:
        error: Any = exc.body
        kind, message = error["error"]["type"], error["error"]["message"]
    else:
        kind = message = None
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    return Read(text, kind, message)


def _chat_stream(gpt: openai.OpenAI) -> Read:
    chunks: list[Any] = []
    with pytest.raises(openai.APIError) as error:
        _read(gpt.chat.completions.create(model="gpt-5", messages=HELLO, stream=True), chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return Read(text, str(error.value.code), error.value.message)


def _responses_stream(gpt: openai.OpenAI) -> Read:
    # The SDK yields the error event as a typed event, the stream's last.
    events = list(gpt.responses.create(model="gpt-5", input="Hello", stream=True))
    last = events[-1]
    assert isinstance(last, ResponseErrorEvent), last
    text = "".join(e.delta for e in events if isinstance(e, ResponseTextDeltaEvent))
    return Read(text, str(last.code), last.message)


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


BREAK = {"chunks": 3, "stall_after_chunks": 1, "fail": "reset_mid_stream"}
"""Key A's stream: reset by the provider after its first text delta ("Hello fro")."""
CUT = Read("Hello fro", "upstream_error")
"""What a client reads of a stream nothing continues: the first delta, then the error event."""


def test_a_stream_the_provider_breaks_ends_with_its_error_event_or_is_resumed(
    fresh: Running, ai_sdk: AiSdk
) -> None:
    """Key A resets each stream after its first delta. The app relays with `relay_stream`, so
    the client's stream ends with the wire's error event, which the SDKs report; with the
    shipped config's `resume_streams`, a Messages stream is instead continued on key B (the
    prefill continued, not repeated) and reads whole. No traceback is logged."""
    claude = anthropic.Anthropic(base_url=fresh.url, api_key="anything", max_retries=0)
    gpt = openai.OpenAI(base_url=f"{fresh.url}/v1", api_key="anything", max_retries=0)
    reads = {"anthropic": _messages_stream, "chat": _chat_stream, "responses": _responses_stream}
    for wire, read in reads.items():
        _behave(fresh, KEYS["MOCK_KEY_A"], {**BREAK, "times": 1})
        seen = read(claude if wire == "anthropic" else gpt)  # type: ignore[operator]
        if wire == "anthropic":  # resumed on key B (Chat's accounts take no prefill)
            assert seen == Read("Hello from the mock provider."), seen
        else:
            assert seen._replace(message=None) == CUT, (wire, seen)
            assert str(seen.message).startswith("upstream stream failed: "), seen
        # A whole answer of the model from key A between two breaks: the faults of the pair
        # (account, model) never add up to a cooling.
        if wire == "anthropic":
            claude.messages.create(model="claude-haiku-5", max_tokens=100, messages=HELLO)
        else:
            gpt.chat.completions.create(model="gpt-5", messages=HELLO)

    _behave(fresh, KEYS["MOCK_KEY_A"], {**BREAK, "times": len(WIRES)})
    calls = [Call(w, "claude-haiku-5" if w == "anthropic" else "gpt-5", True) for w in WIRES]
    for call, outcome in zip(calls, ai_sdk.calls(fresh.url, calls), strict=True):
        if call.wire == "anthropic":
            assert (outcome["text"], outcome["errors"]) == ("Hello from the mock provider.", [])
            continue
        assert outcome["text"] == CUT.text, outcome
        [error] = outcome["errors"]  # the gateway's error event, not a cut connection
        # Responses: the SDK's own stream error, with the event's code and the event as data.
        kind = error["code"] if call.wire == "responses" else error["type"]
        assert kind == CUT.kind, outcome
        assert error["message"].startswith("upstream stream failed: "), outcome

    assert _stop(fresh.app) == 0
    assert "Traceback" not in fresh.log.read_text(), fresh.log.read_text()
