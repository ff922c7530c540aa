"""The shipped alert `SwitchyardAccountCooledTooLong` over account-state series, with
`promtool test rules` (Prometheus's own rule evaluator over simulated time; no server).

The series are what `switchyard.account.state` reads, scraped every 15 s: cooled (2) only while
a cooling period runs, half-open (1) from its end until a probe closes (0) or re-cools it
(tests/core/test_pool_half_open.py and tests/state/test_half_open_live.py show the gauge does).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from servers import ROOT

pytestmark = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="needs promtool (Debian's prometheus)"
)

RULES = ROOT / "examples" / "observability" / "rules.yml"
ALERT = "SwitchyardAccountCooledTooLong"
SCRAPES_PER_MINUTE = 4  # one sample every 15 s


def samples(*phases: tuple[int, float]) -> str:
    """A promtool series of (state, minutes) phases, repeated as written."""
    values: list[str] = []
    for state, minutes in phases:
        values += [str(state)] * round(minutes * SCRAPES_PER_MINUTE)
    return " ".join(values)


def broken(period_min: float, dip_min: float, total_min: float) -> str:
    """An account whose every probe fails: cooled for its period, half-open until the next
    request (the probe) re-cools it."""
    cycles = round(total_min / (period_min + dip_min)) + 1
    return samples(*[(2, period_min), (1, dip_min)] * cycles)


SERIES = {
    # Healed, and nobody asks for its model: cooled for the longest default period (300 s),
    # then half-open for an hour.
    "healed-quiet": samples((2, 5), (1, 60)),
    # A first cooling (30 s), then half-open with no traffic: as above, the common case.
    "healed-short": samples((0, 2), (2, 0.5), (1, 60)),
    # Broken under steady traffic: 30 s periods, the probe 15 s after each ends.
    "broken-busy": broken(0.5, 0.25, 65),
    # Broken, one request a minute and the longest default period: dips of up to a minute.
    "broken-sparse": broken(5, 1, 65),
    # Broken, its period past max_cooldown_secs' default: cooled throughout.
    "cooled-throughout": samples((2, 65)),
    # Healed: the probe after its cooling succeeded.
    "recovered": samples((2, 0.5), (0, 60)),
}
FIRING = ("broken-busy", "broken-sparse", "cooled-throughout")


def alerts(*accounts: str) -> list[dict[str, object]]:
    return [
        {
            "exp_labels": {"switchyard_account": name, "severity": "warning"},
            "exp_annotations": {
                "summary": f"Account {name} has been cooled for 10 minutes",
                "description": (
                    "Every probe since it cooled has failed: a revoked key, an exhausted "
                    "balance or a provider outage. Check /switchyard/accounts and "
                    "switchyard_account_faults_total."
                ),
            },
        }
        for name in accounts
    ]


def test_the_alert_fires_for_broken_accounts_and_never_for_healed_quiet_ones(
    tmp_path: Path,
) -> None:
    checks = [
        # Before 10 minutes nothing fires; from then on only the broken ones, at every minute
        # checked (a dip to half-open never restarts the wait).
        {"eval_time": "9m", "alertname": ALERT, "exp_alerts": []},
        *(
            {"eval_time": f"{minute}m", "alertname": ALERT, "exp_alerts": alerts(*FIRING)}
            for minute in (11, 15, 20, 31, 45, 60)
        ),
    ]
    test = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "15s",
        "tests": [
            {
                "interval": "15s",
                "input_series": [
                    {
                        "series": f'switchyard_account_state{{switchyard_account="{name}"}}',
                        "values": values,
                    }
                    for name, values in SERIES.items()
                ],
                "alert_rule_test": checks,
            }
        ],
    }
    path = tmp_path / "rules_test.yml"
    path.write_text(yaml.safe_dump(test, sort_keys=False))
    done = subprocess.run(
        ["promtool", "test", "rules", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
