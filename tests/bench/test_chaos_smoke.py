"""The chaos soak in its smoke mode, so it cannot rot: every fault of the schedule injected
through both fronts, no defect, every account back, nothing left open or grown."""

from __future__ import annotations

import re
import sys

import pytest

from process_group import run_in_own_group
from redis_server import redis_server_path
from servers import ROOT

pytestmark = pytest.mark.integration  # starts real servers: Redis, uvicorn, the processor, Envoy


@pytest.mark.timeout(330)  # about 50 s quiet; the subprocess has its own bound below
def test_chaos_smoke_meets_its_targets() -> None:
    redis_server_path()  # skips without redis-server, fails where CI requires it
    # Its own process group: whatever ends the test, none of the servers the soak started
    # (gateway, processor, Redis) outlives it.
    code, out, err = run_in_own_group(
        [sys.executable, "bench/chaos.py", "--smoke"], cwd=ROOT, timeout=300
    )
    assert code == 0, out + err
    assert "| defects | 0 | 0 | yes |" in out
    assert "| invalid config reloaded | refused | refused | yes |" in out
    # Envoy's retries moved across the two provider clusters (its own counters).
    assert re.search(r"\| Envoy retries served on another provider's cluster \| [1-9]", out)
    # The metered tenant (both fronts): its limit spent before Redis restarted, every request
    # a whole answer or its 429 with retry-after (or a documented error of the faults), and
    # the tokens charged within the limit plus the degraded mode's bound.
    metered = re.search(r"\| metered tenant's requests \| (.*) \| none lost \| yes \|", out)
    assert metered is not None, out
    assert "metered: 200" in metered.group(1)
    refused = re.search(
        r"\| metered tenant's limit spent \| (\d+) refused \(429\) \| some \| yes", out
    )
    assert refused is not None, out
    assert int(refused.group(1)) > 0
    charged = re.search(
        r"\| metered tenant's tokens charged \| (\d+) of (\d+) \| at most (\d+) \| yes", out
    )
    assert charged is not None, out
    assert 0 < int(charged.group(1)) <= int(charged.group(3)) == 2 * int(charged.group(2))
    # Every kind of injection of the schedule took place during the traffic.
    for injected in (
        "answers 401",
        "answers 503",
        "reset before headers",
        "reset mid stream",
        "stalls",
        "first token after",
        "redis restarted",
        "SIGHUP to gateway and processor",
        "POST reload, valid file: 200",
        "hostile HTTP/2 peer",
    ):
        assert injected in out, injected
    left = re.search(r"(\d+) clients left", out)
    assert left is not None
    assert int(left.group(1)) > 0  # some streaming clients went away mid-answer
    # The processor sent the rapid-reset peer away (its reset budget), each time it came.
    sent_away = [int(n) for n in re.findall(r"(\d+) sent away", out)]
    assert sent_away
    assert all(n > 0 for n in sent_away), sent_away
    assert out.rstrip().endswith("PASS")
