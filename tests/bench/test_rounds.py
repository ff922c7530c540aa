"""The bench's interleaved rounds: each round's CPU per request is kept beside the median, and
each round's ratio to the floor, so that a report shows how far one run's rounds spread.

On a shared machine one server's CPU per request moves between rounds by more than most
changes (the example gateway against the aiohttp floor at 1 KB: 0.51 to 1.02 across twelve
rounds of one run): a ratio read without its rounds cannot say whether it moved.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from servers import ROOT

sys.path.insert(0, str(ROOT / "bench"))

import _harness  # bench/ is a folder of scripts, not a package
from _harness import Load, Result, Target, compare, measure_interleaved


def test_each_target_keeps_its_rounds_cpu_in_round_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # req/s falls round after round while the CPU does not follow it in order: the kept run is
    # the median by req/s, the rounds stay in the order they ran.
    cpu = {"floor": [0.2, 0.3, 0.1], "gateway": [0.4, 0.25, 0.35]}
    seen: dict[str, int] = {"floor": 0, "gateway": 0}

    def fake_run(url: str, *_: object, **__: object) -> Load:
        name = url.rsplit("/", 1)[1]
        i = seen[name]
        seen[name] += 1
        return Load(
            requests=1000 - 100 * i, secs=1.0, errors=0, p50_ms=1, p99_ms=2, cpu_ms=cpu[name][i]
        )

    monkeypatch.setattr(_harness, "_measured_run", fake_run)
    targets = [Target(n, f"http://x/{n}", 1) for n in ("floor", "gateway")]
    loads = measure_interleaved(targets, b"{}", tmp_path, conns=1, secs=1, warmup=0, repeat=3)
    assert loads["floor"].cpu_rounds == (0.2, 0.3, 0.1)
    assert loads["gateway"].cpu_rounds == (0.4, 0.25, 0.35)
    assert loads["gateway"].cpu_ms == 0.25  # the median run by req/s, as before


def _result(name: str, rounds: list[float], cpu: float) -> Result:
    return Result("3 peers", name, req_s=100.0, cpu_ms=cpu, conns=16, cpu_ms_rounds=rounds)


def test_compare_gives_each_rounds_ratio_to_the_floor_of_the_same_round() -> None:
    floor = _result("floor", [0.2, 0.2, 0.3], 0.2)
    gateway = _result("gateway", [0.25, 0.4, 0.3], 0.3)
    compare([floor, gateway], "floor")
    assert gateway.cpu_ratio_rounds == pytest.approx([0.8, 0.5, 1.0])
    assert gateway.extra["cpu_ratio"] == pytest.approx(0.2 / 0.3)


def test_rounds_that_do_not_pair_give_no_round_ratios() -> None:
    floor = _result("floor", [0.2, 0.2], 0.2)
    gateway = _result("gateway", [0.25, 0.4, 0.3], 0.3)
    compare([floor, gateway], "floor")
    assert gateway.cpu_ratio_rounds == []
    assert "cpu_ratio" in gateway.extra
