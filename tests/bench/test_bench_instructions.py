"""`python bench/instructions.py --smoke` counts instructions per request under valgrind.

No number is checked against a target: only that the counter runs, that the figure is a
difference of two real counts (the stack executes more than the bare app it wraps) and that
the report is written. Skipped where valgrind is missing (`.ci/run` installs it).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.integration  # runs the bench's servers under valgrind: minutes, not the inner loop
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")
@pytest.mark.timeout(300)  # a guard against a hang, not a time target
def test_instruction_counts_run_and_are_written(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "instructions.py"),
            "--smoke",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=290,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "| switchyard_stack |" in done.stdout
    counts = json.loads((tmp_path / "instructions.json").read_text())["in process"]
    assert 0 < counts["bare app"] < counts["switchyard_stack"]
