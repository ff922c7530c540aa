"""`python bench/run.py --smoke` runs, prints its table and writes its chart.

Nothing here checks a number: the run only has to complete. Sections that need wrk (or an
Envoy binary) are skipped by the bench itself, with a note, on a machine without them.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # starts real servers

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)  # a guard against a hang, not a time target
def test_bench_smoke_prints_the_table_and_writes_the_chart(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run.py"), "--smoke", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=230,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # A smoke run measures two body sizes: every row at each.
    for size in ("1KB", "32KB"):
        assert f"| switchyard_stack [anthropic] | {size} |" in done.stdout
        # The reference floors are measured in the same run as what is compared with them.
        assert f"| minimal middleware (reference) [anthropic] | {size} |" in done.stdout
        if shutil.which("wrk"):
            assert f"| minimal middleware (reference) | {size} | 16 |" in done.stdout
            necessary = f"| pass-through aiohttp + read_request (necessary work) | {size} | 16 |"
            assert necessary in done.stdout
            if "**4 envoy**" in done.stdout:
                row = f"| Envoy + minimal Python processor (reference) | {size} | 16 |"
                assert row in done.stdout
    assert "**targets**" in done.stdout
    chart = out / "bench.png"
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "results.json").exists()
