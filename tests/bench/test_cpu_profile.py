"""`bench/cpu_profile.py`: perf's report read into CPU per request by function and by what it
is spent on, and a short run of each pair against real servers."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from process_group import run_in_own_group
from servers import ROOT

sys.path.insert(0, str(ROOT / "bench"))

from cpu_profile import (  # bench/ is a folder of scripts, not a package
    HZ,
    Profile,
    by_group,
    difference,
    samples_by_function,
)

REPORT = """\
# Samples: 9K of event 'cpu-clock:pppH'
#
# Overhead       Samples  Symbol
# ........  ............  ...................................
#
    31.84%          2251  [.] _PyEval_EvalFrameDefault                      -      -
     3.73%           264  [.] _PyObject_Malloc                              -      -
     3.71%           262  [k] finish_task_switch.isra.0                     -      -
     0.95%            67  [.] json_skip_string                              -      -
     0.50%            35  [.] gc_collect_main
     0.01%             1  [.] 0x00007f3a2b1c4d10
"""


def test_perf_report_lines_are_samples_by_function_the_kernel_marked() -> None:
    found = samples_by_function(REPORT)
    assert found == {
        "_PyEval_EvalFrameDefault": 2251,
        "_PyObject_Malloc": 264,
        "(kernel) finish_task_switch.isra.0": 262,
        "json_skip_string": 67,
        "gc_collect_main": 35,
        "0x00007f3a2b1c4d10": 1,
    }


def test_samples_become_cpu_per_request() -> None:
    # HZ samples are one second of CPU: over 1,000 requests, 1 ms each.
    profile = Profile("a", 1000, {"f": HZ, "g": HZ // 2})
    assert profile.us_per_request("f") == pytest.approx(1000.0)
    assert profile.us_per_request("absent") == 0.0
    assert profile.total_ms == pytest.approx(1.0 + (HZ // 2) / HZ)


def test_rows_are_sorted_by_what_the_second_adds() -> None:
    first = Profile("1KB", 100, {"f": 100, "g": 50, "h": 10})
    second = Profile("128KB", 50, {"f": 50, "g": 75, "new": 10})
    rows = difference(first, second, top=3)
    # per request: f 1 -> 1 sample, g 0.5 -> 1.5, h 0.1 -> 0, new 0 -> 0.2
    assert [r.function for r in rows] == ["g", "new", "f"]
    assert rows[0].added_us == pytest.approx(1e6 / HZ)
    assert [r.function for r in difference(first, second, top=10)][-1] == "h"


def test_functions_are_summed_by_what_they_are_spent_on() -> None:
    samples = samples_by_function(REPORT)
    groups = {
        r.function: r.second_us for r in by_group(Profile("a", 1, {}), Profile("b", 1, samples))
    }
    per = 1e6 / HZ
    assert groups["interpreter"] == pytest.approx(2251 * per)
    assert groups["allocation"] == pytest.approx(264 * per)
    assert groups["kernel"] == pytest.approx(262 * per)
    assert groups["msgspec"] == pytest.approx(67 * per)
    assert groups["collector"] == pytest.approx(35 * per)
    assert groups["other"] == pytest.approx(1 * per)
    assert list(groups)[-1] == "other"


def _usable_perf() -> bool:
    if shutil.which("perf") is None:
        return False
    done = subprocess.run(
        ["perf", "stat", "-e", "cpu-clock", "true"], capture_output=True, check=False
    )
    return done.returncode == 0


@pytest.mark.integration  # starts the mock upstream, the servers and Envoy
@pytest.mark.skipif(
    not (shutil.which("wrk") and _usable_perf()),
    reason="wrk and a perf that may sample are needed (.ci/run installs linux-perf and wrk)",
)
@pytest.mark.parametrize("pair", ["gateway", "processor"])
@pytest.mark.timeout(300)  # a guard against a hang, not a time target
def test_a_short_run_profiles_both_sides(pair: str, tmp_path: Path) -> None:
    cmd = [sys.executable, "bench/cpu_profile.py", "--pair", pair, "--secs", "1.5", "--top", "5"]
    # In a process group of its own: whatever ends the run, no server it started outlives it.
    code, out, err = run_in_own_group([*cmd, "--out", str(tmp_path)], cwd=ROOT, timeout=280)
    assert code == 0, out[-3000:] + err[-3000:]
    lines = out.splitlines()
    assert lines[0].startswith("CPU per request: ")
    function_rows = [line for line in lines if line.startswith("| `")]
    assert len(function_rows) == 5
    assert "| interpreter |" in out
    assert "_PyEval_EvalFrameDefault" in out  # both sides run Python
    assert (tmp_path / f"cpu_profile-{pair}.json").exists()
