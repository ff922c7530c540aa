"""The README's first command: `python examples/starlette_app.py` on its default config serves
offline, on the bundled mock provider it starts itself (which also plays the judge).

Every step the README's "Start here" shows, in order: its curl lines run as written (ports
moved), the SDK snippet with the official SDKs (the judge answers a label), the metrics and
accounts pages, then the mock's controls, again the README's curl lines: key A refuses (the
same requests fail over to key B, then key A cools) and the judge answers its other label.
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
from typing import Any

import anthropic
import httpx
import openai
import pytest

from servers import ROOT, free_port, wait_for_port

pytestmark = pytest.mark.integration


@dataclass
class Example:
    proc: subprocess.Popen[bytes]
    url: str
    mock_url: str
    log: Path


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Example]:
    # The README's ports, moved as the example's docstring says, so that tests run side by side.
    port, mock_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SWITCHYARD_", "MOCK_"))}
    env |= {"PORT": str(port), "SWITCHYARD_MOCK_PORT": str(mock_port), "LOG_LEVEL": "warning"}
    log = tmp_path_factory.mktemp("example-default") / "example.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "examples/starlette_app.py"],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        try:
            wait_for_port(port)
            wait_for_port(mock_port)
        except TimeoutError:
            proc.kill()
            raise RuntimeError(log.read_text()) from None
        yield Example(proc, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{mock_port}", log)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def test_every_start_here_step_then_ctrl_c(example: Example) -> None:
    claude = anthropic.Anthropic(base_url=example.url, api_key="anything", max_retries=0)
    gpt = openai.OpenAI(base_url=f"{example.url}/v1", api_key="anything", max_retries=0)

    curl, refuse_key_a, judge_simple = readme_curls()
    assert "/_mock/behaviours/mock-key-a" in refuse_key_a
    assert "/_mock/behaviours/mock-judge-key" in judge_simple

    # The README's curl, as written: served by key A, the headers say what was decided.
    headers = _headers(_run(curl, example))
    assert headers["x-switchyard-model"] == "claude-opus-5"
    assert headers["x-switchyard-account"] == "mock-a"
    assert headers["x-switchyard-attempts"] == "1"
    # The same through the SDK.
    raw = _hello(claude)
    assert raw.headers["x-switchyard-model"] == raw.parse().model == "claude-opus-5"
    assert raw.headers["x-switchyard-account"] == "mock-a"
    assert raw.headers["x-switchyard-attempts"] == "1"
    assert raw.headers["x-switchyard-deadline-ms"] == "60000"  # 100 tokens: the 60 s floor
    assert "x-switchyard-route" not in raw.headers  # only routes with a judge carry it
    assert raw.headers.get_list("date") == [raw.headers["date"]]  # one date header, not two

    # The SDK snippet: the text, then the model the judge picked for "auto".
    message = claude.messages.create(
        model="claude-opus-5", max_tokens=100, messages=[{"role": "user", "content": "Hello"}]
    )
    assert message.content[0].type == "text"
    assert message.content[0].text == "Hello from the mock provider."
    raw = _auto(gpt)
    assert raw.headers["x-switchyard-route"] == "judge:complex"
    assert raw.parse().model == "claude-opus-5"

    # The metrics and the accounts' breaker states.
    metrics = httpx.get(f"{example.url}/metrics")
    assert metrics.status_code == 200
    assert "switchyard_variant_assignments_total" in metrics.text
    assert _states(example) == {
        "mock-a": "closed",
        "mock-b": "closed",
        "mock-cloud": "closed",
        "mock-judge": "closed",
    }

    # Key A refuses: the same requests are answered by key B, and the judge still answers;
    # after failure_threshold (3) refusals key A cools and B answers at once.
    _run(refuse_key_a, example)
    assert _behaviours(example)["mock-key-a"]["status"] == 401
    refused = [_hello(claude), _auto(gpt), _hello(claude)]
    assert [
        (r.headers["x-switchyard-account"], r.headers["x-switchyard-attempts"]) for r in refused
    ] == [("mock-b", "2")] * 3
    assert refused[1].headers["x-switchyard-route"] == "judge:complex"
    raw = _hello(claude)
    assert (raw.headers["x-switchyard-account"], raw.headers["x-switchyard-attempts"]) == (
        "mock-b",
        "1",
    )
    assert _states(example)["mock-a"] == "cooled"

    # The judge answers "simple": "auto" now goes to claude-haiku-5.
    _run(judge_simple, example)
    assert _behaviours(example)["mock-judge-key"]["reply"] == "simple"
    raw = _auto(gpt)
    assert raw.headers["x-switchyard-route"] == "judge:simple"
    assert raw.headers["x-switchyard-model"] == raw.parse().model == "claude-haiku-5"

    # Ctrl-C stops the gateway and its mock.
    example.proc.send_signal(signal.SIGINT)
    assert example.proc.wait(15) == 0, example.log.read_text()


def _hello(claude: anthropic.Anthropic) -> Any:
    """The README's curl, through the Anthropic SDK."""
    raw = claude.messages.with_raw_response.create(
        model="claude-opus-5", max_tokens=100, messages=[{"role": "user", "content": "Hello"}]
    )
    assert raw.http_response.status_code == 200
    return raw


def _auto(gpt: openai.OpenAI) -> Any:
    """The README's OpenAI snippet: "auto", a model the judge picks."""
    raw = gpt.chat.completions.with_raw_response.create(
        model="auto", messages=[{"role": "user", "content": "Hello"}]
    )
    assert raw.http_response.status_code == 200
    return raw


def _states(example: Example) -> dict[str, str]:
    r = httpx.get(f"{example.url}/switchyard/accounts")
    assert r.status_code == 200
    return {a["name"]: a["state"] for a in r.json()["accounts"]}


def readme_curls() -> list[str]:
    """The curl lines of the README's "Start here", in order (continuation lines joined)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Start here\n", 1)[1].split("\n## ", 1)[0]
    lines = []
    for block in re.findall(r"```sh\n(.*?)```", section, re.S):
        lines += [ln.strip() for ln in block.replace("\\\n", " ").splitlines()]
    return [line for line in lines if line.startswith("curl ")]


def _run(command: str, example: Example) -> str:
    """A README command as a user runs it, in a shell, with the example's ports moved."""
    moved = command.replace("127.0.0.1:8000", example.url.removeprefix("http://"))
    moved = moved.replace("127.0.0.1:9100", example.mock_url.removeprefix("http://"))
    done = subprocess.run(["bash", "-c", moved], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, (command, done.stderr)
    return done.stdout


def _headers(curl_output: str) -> dict[str, str]:
    """The response headers `curl -D -` printed (names lower-cased)."""
    head = curl_output.split("\r\n\r\n", 1)[0].splitlines()[1:]
    return {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in head)}


def _behaviours(example: Example) -> dict[str, Any]:
    r = httpx.get(f"{example.mock_url}/_mock/behaviours", timeout=5)
    assert r.status_code == 200, r.text
    behaviours: dict[str, Any] = r.json()
    return behaviours
