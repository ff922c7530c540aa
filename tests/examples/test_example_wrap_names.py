"""examples/wrap_your_app.py (uvicorn) in front of an account that knows the model by its own
name: the team's own forwarding code renames the answer with `ctx.account.answer_namer`, so the
official SDKs get the public name, JSON and stream, as through the bundled gateway."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest

from servers import ROOT, free_port, serve_in_thread, wait_for_port
from switchyard_mw.testing import MockProvider

pytestmark = pytest.mark.integration


def config(mock_url: str) -> str:
    return f"""
[llm_clients.vendor]
base_url = "{mock_url}"
api_key_env = "MOCK_KEY_A"
models = {{ "claude-opus-5" = "vendor.claude-opus-5-v1:0", "gpt-5" = "gpt-5-prod" }}
"""


@pytest.fixture(scope="module")
def mock() -> Iterator[tuple[MockProvider, str]]:
    provider = MockProvider()
    with serve_in_thread(provider) as url:
        yield provider, url


@pytest.fixture(scope="module")
def app_url(
    mock: tuple[MockProvider, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    tmp: Path = tmp_path_factory.mktemp("wrap-names")
    (tmp / "switchyard.toml").write_text(config(mock[1]))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SWITCHYARD_", "MOCK_"))}
    env |= {"SWITCHYARD_CONFIG": str(tmp / "switchyard.toml"), "MOCK_KEY_A": "key-a"}
    command = [sys.executable, "-m", "uvicorn", "examples.wrap_your_app:app", "--port", str(port)]
    with (tmp / "app.log").open("wb") as log:
        app = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        try:
            wait_for_port(port)
        except TimeoutError:
            raise RuntimeError((tmp / "app.log").read_text()) from None
        yield f"http://127.0.0.1:{port}"
    finally:
        app.kill()
        app.wait(10)


@pytest.mark.parametrize("stream", [False, True])
def test_the_teams_own_forwarding_code_gives_the_public_name(
    app_url: str, mock: tuple[MockProvider, str], stream: bool
) -> None:
    claude = anthropic.Anthropic(base_url=app_url, api_key="anything", max_retries=0)
    hello = [{"role": "user", "content": "Hello"}]
    if stream:
        with claude.messages.stream(model="claude-opus-5", max_tokens=50, messages=hello) as s:
            names = [e.message.model for e in s if e.type == "message_start"]
            names.append(s.get_final_message().model)
    else:
        names = [claude.messages.create(model="claude-opus-5", max_tokens=50, messages=hello).model]
    assert set(names) == {"claude-opus-5"}
    assert len(names) == (2 if stream else 1)
    assert mock[0].requests[-1].model == "vendor.claude-opus-5-v1:0"
    gpt = openai.OpenAI(base_url=f"{app_url}/v1", api_key="anything", max_retries=0)
    if stream:
        chunks = gpt.chat.completions.create(model="gpt-5", messages=hello, stream=True)  # type: ignore[arg-type]
        models = {chunk.model for chunk in chunks}
    else:
        models = {gpt.chat.completions.create(model="gpt-5", messages=hello).model}  # type: ignore[arg-type]
    assert models == {"gpt-5"}
    assert mock[0].requests[-1].model == "gpt-5-prod"
