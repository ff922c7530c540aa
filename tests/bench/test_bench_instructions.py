"""`python bench/instructions.py --smoke` counts instructions per request under valgrind.

No number is checked against a target: only that the counter runs, that the figure is a
difference of two real counts (the stack executes more than the bare app it wraps) and that
the report is written. Skipped where valgrind is missing (`.ci/run` installs it).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from process_group import run_in_own_group

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.integration  # runs the bench's servers under valgrind: minutes, not the inner loop
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")
@pytest.mark.timeout(300)  # a guard against a hang, not a time target
def test_instruction_counts_run_and_are_written(tmp_path: Path) -> None:
    # Its own process group: a time-out also stops the counts running under valgrind, which
    # a kill of the script alone leaves behind.
    code, out, err = run_in_own_group(
        [sys.executable, str(ROOT / "bench/instructions.py"), "--smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        timeout=290,
    )
    assert code == 0, out[-3000:] + err[-3000:]
    assert "| switchyard_stack |" in out
    counts = json.loads((tmp_path / "instructions.json").read_text())["in process"]
    assert 0 < counts["bare app"] < counts["switchyard_stack"]
