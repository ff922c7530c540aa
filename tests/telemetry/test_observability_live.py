"""The shipped dashboard and alert rules against a real Prometheus scraping the example gateway.

Prometheus (Debian's `prometheus`, which brings `promtool`) runs on a free loopback port and
scrapes the example gateway every second while a scripted mix of traffic runs through it with
the official SDKs: successes and streams, a canary whose variant fails, a refused account that
cools, a throttled account, a slow upstream, a stalled judge, an account whose short cooling
runs out with no request since. Then every PromQL expression in the dashboard, the rules and
docs/telemetry.md must return at least one series, and the alerts that traffic should fire must
be pending or firing.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import yaml

from servers import ROOT, example_gateway, free_port, serve_in_thread, wait_for_port
from switchyard_mw.testing import Behaviour, MockProvider

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs Debian's prometheus"),
]

HERE = ROOT / "examples" / "observability"
NAMES = ("good", "canary", "dead", "slow", "hold", "judge", "healed")
KEYS = {f"KEY_{n.upper()}": f"key-{n}" for n in NAMES}
ALERTS = {
    "SwitchyardAccountCooledTooLong",
    "SwitchyardJudgeFailOpenRateHigh",
    "SwitchyardVariantErrorRateAboveBase",
    "SwitchyardDeadlineExpiriesRising",
}
METERED_KEY = "key-metered"
TURN: Any = [{"role": "user", "content": "Say hello"}]


def gateway_config(mock: str) -> str:
    def account(name: str, models: str, extra: str = "") -> str:
        return (
            f'[llm_clients.{name}]\nbase_url = "{mock}"\napi_key_env = "KEY_{name.upper()}"\n'
            f'auth = "x-api-key"\nmodels = {models}\n{extra}\n'
        )

    return (
        account("good", '["claude-opus-5", "gpt-5", "claude-haiku-5"]', "priority = 1")
        + account("canary", '["claude-opus-5-5"]', "failure_threshold = 100000")
        + account("dead", '["gpt-5"]', "failure_threshold = 1\ncooldown_secs = 300")
        + account("slow", '["slow-model"]', "timeout_secs = 0.2\nfailure_threshold = 100000")
        + account("hold", '["claude-haiku-5"]')
        + account("judge", '["gpt-judge"]')
        + account("healed", '["healed-model"]', "failure_threshold = 1\ncooldown_secs = 3")
        + '[canaries."claude-opus-5"]\nvariants = { "claude-opus-5-5" = 50.0 }\n'
        + "[routes.auto]\n"
        + 'classifier = "llm"\njudge = "judge"\njudge_model = "gpt-judge"\n'
        + "judge_deadline_ms = 100\n"
        + 'choices = { simple = "claude-haiku-5", complex = "claude-opus-5" }\n'
        + 'fallback = "claude-haiku-5"\n'
        # Every client a tenant: the mix's key unlimited, the metered key's small limit
        # refused from the first round on (the tenants panels: cost, refusals, tokens).
        + f'[tenants.everyone]\nkeys = ["{digest("x")}"]\n'
        + f'[tenants.metered]\nkeys = ["{digest(METERED_KEY)}"]\n'
        + 'limits = [{ tokens = 60, per = "day" }]\n'
        + '[prices."claude-haiku-5"]\ninput = 1.0\noutput = 5.0\n'
        + '[prices."claude-opus-5"]\ninput = 15.0\noutput = 75.0\n'
    )


def digest(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


@contextlib.contextmanager
def prometheus(target: str, tmp: Path) -> Iterator[str]:
    port = free_port()
    config = tmp / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"rule_files:\n  - {HERE / 'rules.yml'}\n"
        "scrape_configs:\n  - job_name: switchyard-gateway\n"
        f"    static_configs:\n      - targets: ['{target}']\n"
    )
    log = (tmp / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for_port(port, timeout=30)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


async def traffic_round(gateway: str, index: int) -> None:
    """One round of the mix; the first round is small, so every counter exists before it grows
    (a rate needs the series to have been seen before its increase)."""
    claude = anthropic.AsyncAnthropic(base_url=gateway, api_key="x", max_retries=0)
    metered = anthropic.AsyncAnthropic(base_url=gateway, api_key=METERED_KEY, max_retries=0)
    gpt = openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key="x", max_retries=0)
    many = 1 if index == 0 else 20

    async def quiet(call: Any) -> None:
        with contextlib.suppress(anthropic.APIError, openai.APIError):
            await call

    calls: list[Any] = []
    for user in range(4):  # the canary: about half the users land on the failing variant
        calls.append(
            quiet(
                claude.messages.create(
                    model="claude-opus-5",
                    max_tokens=16,
                    messages=TURN,
                    metadata={"user_id": f"user-{index}-{user}"},
                )
            )
        )
    calls.append(quiet(gpt.chat.completions.create(model="gpt-5", messages=TURN)))
    if index == 1:  # once, when Prometheus scrapes already: it cools for 3 s, then nobody asks
        calls.append(
            quiet(claude.messages.create(model="healed-model", max_tokens=16, messages=TURN))
        )
    calls += [
        quiet(claude.messages.create(model="slow-model", max_tokens=16, messages=TURN))
        for _ in range(many)
    ]
    calls.append(quiet(claude.messages.create(model="auto", max_tokens=16, messages=TURN)))
    calls.append(
        quiet(claude.messages.create(model="claude-haiku-5", max_tokens=16, messages=TURN))
    )
    # Three a round against 60 tokens a day, each reserving about 24: refused from the first.
    calls += [
        quiet(metered.messages.create(model="claude-haiku-5", max_tokens=16, messages=TURN))
        for _ in range(3)
    ]
    await asyncio.gather(*calls)

    async with claude.messages.stream(model="gpt-5", max_tokens=16, messages=TURN) as stream:
        async for _ in stream.text_stream:
            pass
    chunks = await gpt.chat.completions.create(
        model="gpt-5", messages=TURN, stream=True, stream_options={"include_usage": True}
    )
    async for _ in chunks:
        pass
    await claude.close()
    await metered.close()
    await gpt.close()


def expressions() -> dict[str, str]:
    """Every PromQL expression shipped: dashboard panels, rules, the telemetry page."""
    found: dict[str, str] = {}
    dashboard = json.loads((HERE / "grafana-dashboard.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            found[f"dashboard: {panel['title']} {target['refId']}"] = target["expr"].replace(
                "$__rate_interval", "1m"
            )
    rules = yaml.safe_load((HERE / "rules.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            name = rule.get("record") or rule["alert"]
            found[f"rules: {name}"] = rule["expr"]
    docs = (ROOT / "docs" / "telemetry.md").read_text()
    for i, expr in enumerate(re.findall(r"```promql\n(.*?)```", docs, flags=re.S)):
        found[f"docs/telemetry.md #{i + 1}"] = expr.strip()
    return found


def query(prom: str, expr: str) -> list[Any]:
    answer = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert answer["status"] == "success", (expr, answer)
    result: list[Any] = answer["data"]["result"]
    return result


@pytest.fixture(scope="module")
def mock() -> Iterator[MockProvider]:
    provider = MockProvider()
    with serve_in_thread(provider) as url:
        provider.url = url  # type: ignore[attr-defined]
        yield provider


def test_dashboard_rules_and_docs_queries_all_return_series(
    mock: MockProvider, tmp_path: Path
) -> None:
    promtool = subprocess.run(
        ["promtool", "check", "rules", str(HERE / "rules.yml")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert promtool.returncode == 0, promtool.stdout + promtool.stderr
    mock.set_behaviour("key-canary", Behaviour(status=400))  # no failover hides it
    mock.set_behaviour("key-dead", Behaviour(status=401))
    mock.set_behaviour("key-slow", Behaviour(headers_delay_secs=1.0))
    mock.set_behaviour("key-hold", Behaviour(status=429, headers={"retry-after": "2"}))
    mock.set_behaviour("key-judge", Behaviour(headers_delay_secs=1.0))
    mock.set_behaviour("key-healed", Behaviour(status=500))
    url: str = mock.url  # type: ignore[attr-defined]
    with (
        example_gateway(gateway_config(url), tmp_path, KEYS) as gateway,
        prometheus(gateway.removeprefix("http://"), tmp_path) as prom,
    ):
        for index in range(5):
            asyncio.run(traffic_round(gateway, index))
            time.sleep(2.5)  # at least two scrapes between rounds
        missing = {name: expr for name, expr in expressions().items() if not query(prom, expr)}
        assert missing == {}, sorted(missing)
        # The mix repeats its turns on the same accounts: the mock's prompt cache reads them,
        # and the cache-hit panel shows a ratio of input tokens between 0 and 1.
        ratio = expressions()["dashboard: Prompt cache hit ratio by model and account A"]
        ratios = [float(series["value"][1]) for series in query(prom, ratio)]
        assert any(0 < r <= 1 for r in ratios), ratios
        deadline = time.monotonic() + 20
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            alerts = httpx.get(f"{prom}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
            states = {a["labels"]["alertname"]: a["state"] for a in alerts}
            if set(states) >= ALERTS:
                break
            time.sleep(1)
        assert set(states) >= ALERTS, states
        assert {states[a] for a in ALERTS} <= {"pending", "firing"}
        # The account whose cooling ran out: scraped cooled (2) while its 3 s ran, half-open
        # (1) since, with no request (tests/telemetry/test_alert_rules.py: such a series
        # never fires the alert; before, it read 2 for as long as nobody asked).
        healed = 'switchyard_account_state{switchyard_account="healed"}'
        assert [float(s["value"][1]) for s in query(prom, healed)] == [1.0]
        seen = query(prom, f"max_over_time({healed}[2m])")
        assert [float(s["value"][1]) for s in seen] == [2.0]
        # The shipped renderer draws the key panels from this Prometheus (docs/dashboard.png
        # is made this way: SWITCHYARD_RENDER_DASHBOARD=docs/dashboard.png).
        out = Path(os.environ.get("SWITCHYARD_RENDER_DASHBOARD") or tmp_path / "dashboard.png")
        subprocess.run(
            [sys.executable, str(HERE / "render.py"), prom, str(out), "--minutes", "1"],
            check=True,
            timeout=120,
        )
        assert out.stat().st_size > 20_000
