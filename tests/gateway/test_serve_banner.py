"""What `switchyard-mw serve` says on start (`banner`): the records, and no secret in them."""

from __future__ import annotations

import logging

import pytest

from switchyard_mw.config import parse_config
from switchyard_mw.gateway.serve import banner

CONFIG = """
[llm_clients.a]
base_url = "https://api.anthropic.com"
api_key_env = "BANNER_KEY"
models = {{ "claude-opus-5" = "vendor.opus" }}

[routes.auto]
classifier = "llm"
judge = "a"
judge_model = "claude-opus-5"
choices = {{ simple = "claude-opus-5" }}
fallback = "claude-opus-5"
{state}
"""
REDIS = '[state]\nbackend = "redis"\nurl = "redis://user:s3cret@redis.internal:6379/0"\n'


RECORD_OWN = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}
"""A record's own attributes, and those a formatter adds when it formats the record (a
handler another test left on the root logger may have): what is not among them came as
`extra`."""


def _banner(caplog: pytest.LogCaptureFixture, state: str, workers: int) -> list[dict[str, object]]:
    config = parse_config(CONFIG.format(state=state), source="x.toml")
    with caplog.at_level(logging.INFO, logger="switchyard_mw.serve"):
        banner(config, "/etc/x.toml", url="http://0.0.0.0:8000", workers=workers)
    return [
        {k: v for k, v in r.__dict__.items() if k not in RECORD_OWN} | {"message": r.msg.phrase}  # type: ignore[attr-defined]
        for r in caplog.records
    ]


def test_the_banner_names_config_accounts_routes_and_state(
    caplog: pytest.LogCaptureFixture,
) -> None:
    serving, account, route, state, routes = _banner(caplog, "", workers=1)
    assert serving == {
        "event": "serve.start",
        "message": "serving",
        "config": "/etc/x.toml",
        "url": "http://0.0.0.0:8000",
        "workers": 1,
    }
    assert account["account"] == "a"
    assert account["models"] == ["claude-opus-5"]  # the public names
    assert account["base_url"] == "https://api.anthropic.com"
    assert (route["model"], route["judge"], route["choices"]) == ("auto", "a", ["claude-opus-5"])
    assert state == {"event": "serve.start", "message": "state", "backend": "memory"}
    llm = {"POST /v1/messages", "POST /v1/chat/completions", "POST /v1/responses"}
    assert llm <= set(routes["llm"])  # type: ignore[arg-type]
    assert "POST /v1/messages/count_tokens" in routes["llm"]  # type: ignore[operator]
    assert routes["local"] == ["GET /v1/models", "GET /v1/models/{id}", "* /v1/... (404)"]
    assert routes["operator_clients"] == ["loopback"]


def test_with_workers_the_state_says_whether_they_share_health(
    caplog: pytest.LogCaptureFixture,
) -> None:
    state = _banner(caplog, "", workers=2)[3]
    assert state["shared"] == "no: each process cools accounts on its own"
    caplog.clear()
    state = _banner(caplog, REDIS, workers=2)[3]
    assert state["backend"] == "redis"
    assert state["where"] == "redis://redis.internal:6379/0"  # no user, no password
    assert state["shared"] == "yes: every worker and replica"
    assert "s3cret" not in caplog.text
