"""docs/migrating-from-litellm.md: its worked example translates to exactly what it shows."""

from __future__ import annotations

import re
from io import StringIO
from pathlib import Path

import pytest

from switchyard_mw.cli import check_config, from_litellm
from switchyard_mw.migrate import translate_litellm

DOC = Path(__file__).resolve().parents[2] / "docs" / "migrating-from-litellm.md"


def block(name: str) -> str:
    """The fenced block under `<!-- worked-example: NAME -->`."""
    found = re.search(
        rf"<!-- worked-example: {re.escape(name)} -->\n```\w*\n(.*?)```", DOC.read_text(), re.S
    )
    assert found is not None, f"no worked-example block {name!r} in {DOC.name}"
    return found.group(1)


def test_the_worked_example_prints_what_the_doc_shows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    Path("config.yaml").write_text(block("config.yaml"))
    out, err = StringIO(), StringIO()
    assert from_litellm("config.yaml", out=out, err=err) == 0
    assert out.getvalue() == block("stdout")
    assert err.getvalue() == block("stderr")


def test_the_worked_example_passes_check_config(tmp_path: Path) -> None:
    translation = translate_litellm(block("config.yaml"), source="config.yaml", environ={})
    target = tmp_path / "switchyard.toml"
    target.write_text(translation.toml)
    out, err = StringIO(), StringIO()
    assert check_config(str(target), out=out, err=err, check_env=False) == 0, err.getvalue()
    names = ["azure-my-endpoint-europe", "azure-my-endpoint-canada", "openai", "anthropic"]
    for name in [*names, "bedrock-us-east-1"]:
        assert f"  {name}: " in out.getvalue()
