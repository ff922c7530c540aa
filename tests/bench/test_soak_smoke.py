"""The soak script in its smoke mode, so it cannot rot: errors 0, no growth, nothing left open."""

from __future__ import annotations

import subprocess
import sys

import pytest

from servers import ROOT

pytestmark = pytest.mark.integration  # starts real servers


def test_soak_smoke_meets_its_targets() -> None:
    result = subprocess.run(
        [sys.executable, "bench/soak.py", "--smoke"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "errors beyond injected     0" in result.stdout
    assert result.stdout.rstrip().endswith("PASS")
