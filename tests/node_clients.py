"""The Vercel AI SDK (`ai`, `@ai-sdk/openai`, `@ai-sdk/anthropic`) as a client in tests, in Node.

The packages are those pinned in `tests/wire/js/package-lock.json`, installed with `npm ci` once
per test session into a temporary folder (npm's own cache makes a second session's install
quick). Tests skip when `node` or `npm` is not installed, unless SWITCHYARD_REQUIRE_NODE=1 (set by
`.ci/run`): there a missing Node is a failure, not a silent skip.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any, NamedTuple

import pytest

JS = Path(__file__).parent / "wire" / "js"
FILES = ("package.json", "package-lock.json", "read_errors.mjs")
INSTALL_SECS = 300.0
CALL_SECS = 60.0


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        if os.environ.get("SWITCHYARD_REQUIRE_NODE") == "1":
            pytest.fail(f"{name} is not installed (SWITCHYARD_REQUIRE_NODE=1)")
        pytest.skip(f"{name} is not installed")
    return path


class Call(NamedTuple):
    wire: str
    """anthropic, chat or responses (`@ai-sdk/openai`'s Chat Completions or Responses model)"""
    model: str
    stream: bool


class AiSdk:
    """The installed packages and the script that calls the gateway with them."""

    def __init__(self, folder: Path) -> None:
        self.node = _tool("node")
        npm = _tool("npm")
        for name in FILES:
            shutil.copy(JS / name, folder / name)
        done = subprocess.run(
            [npm, "ci", "--prefer-offline", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=folder,
            capture_output=True,
            text=True,
            timeout=INSTALL_SECS,
            check=False,
        )
        if done.returncode != 0:
            pytest.fail(f"npm ci failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        self.folder = folder

    def calls(self, base_url: str, calls: list[Call]) -> list[dict[str, Any]]:
        """What the SDK reported for each call, in order: `{"text": ..., "errors": [fields of
        each error]}`. The calls run at once in one Node process."""
        wanted = [{"wire": c.wire, "model": c.model, "stream": c.stream} for c in calls]
        done = subprocess.run(
            [self.node, "read_errors.mjs", base_url, json.dumps(wanted)],
            cwd=self.folder,
            capture_output=True,
            text=True,
            timeout=CALL_SECS,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        outcomes: list[dict[str, Any]] = json.loads(done.stdout.strip().splitlines()[-1])
        return outcomes
