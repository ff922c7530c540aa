"""docs/telemetry.md names exactly what `telemetry/names.py` defines: none missing or invented."""

from __future__ import annotations

import re

from servers import ROOT
from switchyard_mw.telemetry import names as tm
from switchyard_mw.telemetry import request_metrics as rm

DOC = (ROOT / "docs" / "telemetry.md").read_text()


def section(title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", DOC, flags=re.M | re.S)
    assert match, f"docs/telemetry.md has no '## {title}' section"
    return match.group(1)


def table_rows(text: str) -> list[list[str]]:
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and not re.match(r"^\|[-| ]+\|$", line):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows[1:]  # without the header row


def first_names(title: str) -> set[str]:
    names = set()
    for row in table_rows(section(title)):
        match = re.fullmatch(r"`([^`]+)`", row[0])
        assert match, f"{title}: first cell is not one `name`: {row[0]!r}"
        names.add(match.group(1))
    return names


def constants(prefix: str = "") -> dict[str, str]:
    """Every telemetry name in `telemetry.py`: its upper-case string constants."""
    return {
        key: value
        for key, value in vars(tm).items()
        if key.isupper() and isinstance(value, str) and key != "SCOPE" and key.startswith(prefix)
    }


def metric_constants() -> set[str]:
    return {v for v in constants().values() if v in _instrument_names()}


def _instrument_names() -> set[str]:
    # The instruments are module attributes too; their names are the metric names.
    # The request metrics are tallied apart (request_metrics) and exported as histograms.
    return (
        {
            getattr(value, "name", None) or getattr(value, "_name", "")
            for value in vars(tm).values()
            if type(value).__name__.endswith(("Counter", "Histogram", "Gauge"))
        }
        | {tally.name for tally in rm.TALLIES}
        | {tm.ACCOUNT_STATE}
    )


def test_every_name_in_the_code_is_documented_and_every_documented_name_exists() -> None:
    documented = first_names("Spans") | first_names("Attributes") | first_names("Metrics")
    emitted = set(constants().values())
    assert emitted - documented == set(), "emitted but not documented"
    assert documented - emitted == set(), "documented but not in telemetry.py"


def test_each_name_is_in_its_right_table() -> None:
    spans = {v for k, v in constants("SPAN_").items()}
    metrics = metric_constants()
    assert first_names("Spans") == spans
    assert first_names("Metrics") == metrics
    assert first_names("Attributes") == set(constants().values()) - spans - metrics


def prometheus_names() -> set[str]:
    names = set()
    histograms = {tm.JUDGE_DURATION: "s", tm.RESUMED_BYTES: "By"} | {
        t.name: t.unit for t in rm.TALLIES
    }
    gauges = {tm.ACCOUNT_STATE}
    for name in metric_constants():
        base = name.replace(".", "_")
        if name in histograms:
            unit = "_seconds" if histograms[name] == "s" else ""
            names |= {f"{base}{unit}{s}" for s in ("", "_bucket", "_sum", "_count")}
        elif name in gauges:
            names.add(base)
        elif name == tm.COST:  # a unit that is not a `{count}`: the exporter appends it
            names.add(f"{base}_USD_total")
        else:
            names.add(f"{base}_total")
    return names


def test_prometheus_column_and_queries_use_real_series_names() -> None:
    column = {re.sub(r"`", "", row[2]) for row in table_rows(section("Metrics"))}
    assert column <= prometheus_names()
    queries = re.findall(r"```promql\n(.*?)```", DOC, flags=re.S)
    assert len(queries) == 6
    labels = {label.replace(".", "_") for f in tm.METRIC_LABELS.values() for label in f}
    used = set(re.findall(r"\bswitchyard_\w+", "\n".join(queries))) - labels
    assert used <= prometheus_names()
    assert {"switchyard_classifier_fail_open_total", "switchyard_account_cooled_total"} <= used
    assert "switchyard_deadline_exceeded_total" in used
