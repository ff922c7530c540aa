"""What the ext_proc server exposes of an account whose cooling ran out with no request since.

The processor's `switchyard.account.state` gauge (its only view of account health: it serves
no `/switchyard/accounts` page) reads cooled (2) while the period runs and half-open (1) from
its end, with no request sent to let the probe go. A fault reaches the pool through the
servicer, as Envoy sends it; the pool's clock is injected.
"""

from __future__ import annotations

import msgspec

from conftest import Metrics
from extproc_helpers import Stream, request_body, request_headers, response_headers
from switchyard_mw.accounts import build_accounts
from switchyard_mw.config import parse_config
from switchyard_mw.extproc import ExtProcServicer, Policies
from switchyard_mw.telemetry import names as tm

# Account names of their own: the gauge reports every pool alive in the test session.
CONFIG = """
[llm_clients.xp-ho]
base_url = "https://prov.example"
api_key_env = "KEY_XP_HO"
auth = "x-api-key"
models = ["xp-ho-model"]
failure_threshold = 1
cooldown_secs = 20
envoy_cluster = "prov"

[llm_clients.xp-ho-pair]
base_url = "https://prov.example"
api_key_env = "KEY_XP_HO_PAIR"
auth = "x-api-key"
models = ["xp-ho-model", "xp-ho-other"]
priority = 1
failure_threshold = 1
cooldown_secs = 20
envoy_cluster = "prov"
"""
ENV = {"KEY_XP_HO": "secret-1", "KEY_XP_HO_PAIR": "secret-2"}


class FakeClock:
    def __init__(self) -> None:
        self.now = 5000.0

    def __call__(self) -> float:
        return self.now


def state(metrics: Metrics, account: str, model: str | None = None) -> float:
    """The gauge's point of `account` (with `model`: of that pair)."""
    if model is not None:
        return metrics.value(tm.ACCOUNT_STATE, **{tm.ACCOUNT: account, tm.RESPONSE_MODEL: model})
    return metrics.value(tm.ACCOUNT_STATE, **{tm.ACCOUNT: account})


async def fault(servicer: ExtProcServicer, status: int) -> None:
    """One request through the processor whose attempt the upstream answers with `status`."""
    stream = Stream(servicer)
    await stream.send(request_headers())
    messages = [{"role": "user", "content": "x"}]
    body = {"model": "xp-ho-model", "max_tokens": 16, "messages": messages}
    await stream.send(request_body(msgspec.json.encode(body)))
    await stream.send(response_headers(status, details="via_upstream"))
    await stream.close()


async def test_the_processors_gauge_reads_half_open_once_the_period_ran_out(
    otel_metrics: Metrics,
) -> None:
    clock = FakeClock()
    config = parse_config(CONFIG)
    policies = Policies(config, build_accounts(config, ENV), clock=clock)
    servicer = ExtProcServicer(policies)
    await fault(servicer, 401)  # xp-ho's key refused: the account cools
    await fault(servicer, 503)  # then xp-ho-pair's 5xx: its pair for the model cools
    assert policies.pool.status_of("xp-ho").consecutive_faults == 1
    assert policies.pool.status_of("xp-ho-pair", model="xp-ho-model").consecutive_faults == 1
    clock.now += 19.999
    assert state(otel_metrics, "xp-ho") == 2
    assert state(otel_metrics, "xp-ho-pair", "xp-ho-model") == 2
    clock.now += 0.001  # the period's end exactly; no request since
    assert state(otel_metrics, "xp-ho") == 1
    assert state(otel_metrics, "xp-ho-pair", "xp-ho-model") == 1
    # The account's own point reads 0 (its key is fine): the sum over its points is the pair's.
    assert state(otel_metrics, "xp-ho-pair") == 1
