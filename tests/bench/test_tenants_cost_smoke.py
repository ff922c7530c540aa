"""`bench/tenants_cost.py` in a short run, so it cannot rot: its table has a row per request
shape, each with a positive cost with and without tenants."""

from __future__ import annotations

import re
import subprocess
import sys

from servers import ROOT


def test_the_tenants_cost_bench_prints_its_table() -> None:
    done = subprocess.run(
        [sys.executable, "bench/tenants_cost.py", "--repeat", "1", "--number", "5"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    rows = re.findall(
        r"^\| (\w+ (?:JSON|stream)) \| ([\d.]+) \| ([\d.]+) \| (-?[\d.]+) \|$", done.stdout, re.M
    )
    assert [row[0] for row in rows] == [
        "messages JSON",
        "messages stream",
        "chat JSON",
        "chat stream",
    ]
    assert all(float(off) > 0 and float(on) > 0 for _, off, on, _ in rows)
