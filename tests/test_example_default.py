"""The README's first command: `python examples/starlette_app.py` on its default config serves
offline, on the bundled mock provider it starts itself (which also plays the judge)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from servers import ROOT, free_port, wait_for_port

MOCK_PORT = 9100  # the default config's base_url


@pytest.fixture
def example(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SWITCHYARD_", "MOCK_"))}
    env.update({"PORT": str(port), "LOG_LEVEL": "warning"})
    log = (tmp_path / "example.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "examples/starlette_app.py"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        try:
            wait_for_port(port)
            wait_for_port(MOCK_PORT)
        except TimeoutError:
            proc.kill()
            raise RuntimeError((tmp_path / "example.log").read_text()) from None
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def test_the_example_runs_offline_on_its_own_mock(example: str) -> None:
    message = {
        "model": "claude-haiku-5",
        "max_tokens": 100,
        "messages": [{"role": "user", "content": "Hello"}],
    }
    r = httpx.post(f"{example}/v1/messages", json=message, headers={"x-api-key": "anything"})
    assert r.status_code == 200
    assert r.json()["content"][0]["text"]
    assert r.headers["x-switchyard-account"] == "mock-a"
    assert r.headers.get_list("date") == [r.headers["date"]]  # one date header, not two

    chat = {"model": "auto", "messages": [{"role": "user", "content": "Plan a launch"}]}
    r = httpx.post(
        f"{example}/v1/chat/completions", json=chat, headers={"authorization": "Bearer x"}
    )
    assert r.status_code == 200
    assert r.headers["x-switchyard-route"] == "judge:complex"
    assert r.json()["model"] in ("claude-opus-5", "claude-opus-5-5")  # complex, maybe canaried
    assert "switchyard_variant_assignments_total" in httpx.get(f"{example}/metrics").text
