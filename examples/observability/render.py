"""Draw the dashboard's key panels from a Prometheus, for a reader without Grafana at hand.

    python examples/observability/render.py http://127.0.0.1:9090 docs/dashboard.png

Each panel runs the same PromQL as grafana-dashboard.json (with `$__rate_interval` as 1m) over
the last `--minutes` (default 5) and draws one line per series. Needs matplotlib and httpx
(both in the `dev` extra).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
PANELS = (
    "Requests per second by routed model and variant",
    "Error rate by routed model and variant",
    "Latency p50 / p99 by model and variant",
    "Time to first token p50 / p99 (streams)",
    "Tokens per second by model and type",
    "Account state",
    "Deadline expiries by phase",
    "Judge fail-opens by reason",
)


def _legend(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)


def _series(prom: str, expr: str, start: float, end: float) -> list[dict[str, Any]]:
    answer = httpx.get(
        f"{prom}/api/v1/query_range",
        params={"query": expr, "start": start, "end": end, "step": max(1.0, (end - start) / 200)},
        timeout=30,
    ).json()
    result: list[dict[str, Any]] = answer.get("data", {}).get("result", [])
    return result


def render(prom: str, out: Path, *, minutes: float = 5.0) -> None:
    """Write a PNG of the key panels, as Prometheus answers them now."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dashboard = json.loads((HERE / "grafana-dashboard.json").read_text())
    panels = {p["title"]: p for p in dashboard["panels"]}
    end = time.time()
    start = end - minutes * 60
    fig, axes = plt.subplots(4, 2, figsize=(14, 14))
    for ax, title in zip(axes.flat, PANELS, strict=True):
        panel = panels[title]
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", "1m")
            for series in _series(prom, expr, start, end):
                points = [(float(t) - end, float(v)) for t, v in series["values"]]
                if points:
                    xs, ys = zip(*points, strict=True)
                    ax.plot(xs, ys, label=_legend(target["legendFormat"], series["metric"]))
        ax.set_title(f"{title} [{panel['fieldConfig']['defaults']['unit']}]", fontsize=10)
        ax.set_xlabel("seconds before now", fontsize=8)
        ax.tick_params(labelsize=8)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper left")
    fig.suptitle("switchyard-mw dashboard, rendered from Prometheus", fontsize=13)
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prometheus", help="e.g. http://127.0.0.1:9090")
    parser.add_argument("out", type=Path, help="the PNG to write")
    parser.add_argument("--minutes", type=float, default=5.0)
    args = parser.parse_args()
    render(args.prometheus, args.out, minutes=args.minutes)


if __name__ == "__main__":
    main()
