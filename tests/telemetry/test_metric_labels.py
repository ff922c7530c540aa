"""One label name per concept across every metric family (the contract's third round).

`names.METRIC_LABELS` says each family's labels. Checked here: no two families name one
concept differently, every call site that records a family passes exactly its labels, the
request metrics and the account-state gauge too, and docs/telemetry.md, the Grafana dashboard
and the Prometheus rules use only those labels (their queries are run against a real
Prometheus in test_observability_live.py).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator, Mapping

import pytest
import yaml

from servers import ROOT
from switchyard_mw.core.pool import AccountPool, AccountSpec, Outcome
from switchyard_mw.telemetry import names as tm
from switchyard_mw.telemetry import request_metrics as rm

CONCEPTS = {
    tm.ACCOUNT: "the account",
    tm.REQUEST_MODEL: "the model asked for",
    tm.RESPONSE_MODEL: "the model routed to",
    tm.VARIANT: "the canary variant",
    tm.ERROR_TYPE: "what failed",
    tm.SHADOW: "a mirrored request",
    tm.TOKEN_TYPE: "input or output tokens",
    "route": "the judge route",
    "reason": "why it happened (a judge failed open, an answer's usage was not read, a fallback)",
    "outcome": "how the judge call ended",
    "status": "the attempt's status",
    "phase": "the deadline that expired",
    "key": "what the canary split was keyed on",
    "header": "the budget header",
    "result": "how a reload ended",
    tm.TENANT: "the tenant (its configured name)",
    "limit": "the limit that refused (measure/window[/model])",
}
"""Each label any family uses, and the concept it names: a concept appears once."""
FIXED = {"le", "otel_scope_name", "otel_scope_version", "job", "instance", "__name__"}
"""Labels Prometheus or the exporter add to every series."""


def clashes(families: Mapping[str, tuple[str, ...]]) -> list[tuple[str, str]]:
    """Pairs of labels that look like one concept named twice: a label without a namespace
    whose last word is the last part of a namespaced one (`account` and `switchyard.account`,
    `route_model` and `gen_ai.response.model`)."""
    labels = {label for family in families.values() for label in family}
    dotted = {label.rsplit(".", 1)[-1]: label for label in labels if "." in label}
    found = []
    for label in sorted(label for label in labels if "." not in label):
        word = re.split(r"[._]", label)[-1]
        if word in dotted:
            found.append((label, dotted[word]))
    return found


def test_no_two_families_name_one_concept_differently() -> None:
    used = {label for labels in tm.METRIC_LABELS.values() for label in labels}
    assert used - set(CONCEPTS) == set(), "a label of no known concept: add it to CONCEPTS"
    named = list(CONCEPTS.values())
    assert len(named) == len(set(named)), "one concept, two labels"
    assert clashes(tm.METRIC_LABELS) == []


def test_the_check_catches_the_labels_of_before() -> None:
    """What the families said before the third round: the check must flag each clash."""
    before = {
        tm.ACCOUNT_FAULTS: ("account", "status"),
        tm.FAILOVERS: ("route_model",),
        tm.VARIANT_ASSIGNMENTS: ("model", "variant", "key"),
        tm.OPERATION_DURATION: (tm.REQUEST_MODEL, tm.RESPONSE_MODEL, tm.VARIANT, tm.ACCOUNT),
    }
    assert {label for label, _ in clashes(before)} == {"account", "route_model", "model", "variant"}


def test_every_family_is_in_the_table() -> None:
    instruments = {
        getattr(value, "name", None) or getattr(value, "_name", "")
        for value in vars(tm).values()
        if type(value).__name__.endswith(("Counter", "Histogram", "Gauge"))
    }
    families = instruments | {t.name for t in rm.TALLIES} | {tm.ACCOUNT_STATE}
    assert families == set(tm.METRIC_LABELS)


def _call_sites() -> Iterator[tuple[str, str, set[str]]]:
    """(where, family, label names) of every `tm.<instrument>.add/record(..., {...})` in src."""
    instruments = {
        key: getattr(value, "name", None) or getattr(value, "_name", "")
        for key, value in vars(tm).items()
        if type(value).__name__.endswith(("Counter", "Histogram"))
    }
    for path in sorted((ROOT / "src" / "switchyard_mw").rglob("*.py")):
        if "_protos" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            target = node.func.value
            if not (
                node.func.attr in ("add", "record")
                and isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id == "tm"
                and target.attr in instruments
            ):
                continue
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            found = [a for a in node.args[1:] if isinstance(a, ast.Dict)]
            if len(node.args) == 1:
                yield where, instruments[target.attr], set()
                continue
            assert len(found) == 1, f"{where}: labels not given as a dict literal"
            yield where, instruments[target.attr], {_key(k, where) for k in found[0].keys}


def _key(node: ast.expr | None, where: str) -> str:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        value = getattr(tm, node.attr)
        assert isinstance(value, str), where
        return value
    raise AssertionError(f"{where}: a label name that is neither a literal nor a tm constant")


def test_every_call_site_records_its_familys_labels() -> None:
    sites = list(_call_sites())
    wrong = [(w, f, sorted(got)) for w, f, got in sites if got != set(tm.METRIC_LABELS[f])]
    assert wrong == []
    recorded = {family for _, family, _ in sites}
    # Each counter and the judge histogram is recorded somewhere (the scan finds them).
    assert recorded >= set(tm.METRIC_LABELS) - {t.name for t in rm.TALLIES} - {
        tm.ACCOUNT_STATE,
        tm.VARIANT_ASSIGNMENTS,  # an observable counter, checked below
    }


def test_the_tallied_families_use_the_same_labels() -> None:
    assert tm.variant_assignments._names == tm.METRIC_LABELS[tm.VARIANT_ASSIGNMENTS]
    for tally in rm.TALLIES:
        names = set(rm._NAMES) - ({tm.TOKEN_TYPE} if tally is not rm.token_usage else set())
        assert names == set(tm.METRIC_LABELS[tally.name])


def test_the_account_state_gauge_uses_the_account_and_routed_model_labels() -> None:
    """The account alone; a pair whose health differs (a model fault of an account serving
    several models) adds a point with the model routed to, named as every family names it."""
    pool = AccountPool(
        [
            AccountSpec(name="labels-a", models=frozenset({"m"})),
            AccountSpec(name="labels-b", models=frozenset({"m", "n"}), failure_threshold=1),
        ]
    )
    lease = pool.acquire("n", allowed={"labels-b"})
    assert lease is not None
    pool.record(lease, Outcome.FAULT)
    rm.watch(pool)
    try:
        observed = [
            (dict(o.attributes or {}), o.value)
            for o in rm._observe_states(None)  # type: ignore[arg-type]
            if {"labels-a", "labels-b"} & set((o.attributes or {}).values())
        ]
    finally:
        rm.unwatch(pool)
    assert sorted(observed, key=str) == sorted(
        [
            ({tm.ACCOUNT: "labels-a"}, rm.CLOSED),
            ({tm.ACCOUNT: "labels-b"}, rm.CLOSED),
            ({tm.ACCOUNT: "labels-b", tm.RESPONSE_MODEL: "n"}, rm.COOLED),
        ],
        key=str,
    )
    labels = {label for attributes, _ in observed for label in attributes}
    assert labels == set(tm.METRIC_LABELS[tm.ACCOUNT_STATE])


# --- what users read: the docs table, the dashboard, the rules ---------------------------------

DOC = (ROOT / "docs" / "telemetry.md").read_text()
HERE = ROOT / "examples" / "observability"


def _documented_labels() -> dict[str, set[str]]:
    """The labels column of docs/telemetry.md's metrics table: the `names` outside brackets."""
    table = DOC.split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    out: dict[str, set[str]] = {}
    previous: set[str] = set()
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if (
            len(cells) != 5
            or not cells[0].startswith("`")
            or cells[0].strip("`") not in tm.METRIC_LABELS
        ):
            continue
        column = re.sub(r"\([^()]*\)", "", cells[3])
        labels = set(re.findall(r"`([^`]+)`", column))
        if column.startswith("as above"):
            labels |= previous
        out[cells[0].strip("`")] = labels
        previous = labels
    return out


def test_the_docs_table_lists_each_familys_labels() -> None:
    documented = _documented_labels()
    assert set(documented) == set(tm.METRIC_LABELS)
    assert documented == {f: set(labels) for f, labels in tm.METRIC_LABELS.items()}


def _prometheus(label: str) -> str:
    return label.replace(".", "_")


def _queries() -> Iterator[tuple[str, str]]:
    dashboard = json.loads((HERE / "grafana-dashboard.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            yield f"dashboard {panel['title']}", target["expr"] + " " + target["legendFormat"]
    for group in yaml.safe_load((HERE / "rules.yml").read_text())["groups"]:
        for rule in group["rules"]:
            text = rule["expr"] + json.dumps(rule.get("annotations", {}))
            yield f"rules {rule.get('record') or rule['alert']}", text
    for i, expr in enumerate(re.findall(r"```promql\n(.*?)```", DOC, flags=re.S)):
        yield f"docs/telemetry.md #{i + 1}", expr


_LABEL_USES = (
    r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)",
    r"\{\{\s*\$?(?:labels\.)?([a-z_][a-z0-9_]*)\s*\}\}",
    r"[{,]\s*([a-z_][a-z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"",
    r"label_replace\([^,]*,\s*\"([a-z_0-9]+)\"",
)


@pytest.mark.parametrize("pattern", _LABEL_USES)
def test_the_dashboard_rules_and_docs_use_only_real_labels(pattern: str) -> None:
    real = {_prometheus(label) for labels in tm.METRIC_LABELS.values() for label in labels}
    unknown = {}
    for where, text in _queries():
        for match in re.findall(pattern, text):
            names = {n.strip() for n in match.split(",") if n.strip()}
            if names - real - FIXED:
                unknown[where] = sorted(names - real - FIXED)
    assert unknown == {}
