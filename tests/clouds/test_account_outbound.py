"""`ctx.account.outbound(path, body)`: what a team's own forwarding code sends to an account of
any kind (URL, headers after the credential, body), without a signer of its own."""

from __future__ import annotations

import json

import pytest

from switchyard_mw.accounts import build_accounts
from switchyard_mw.config import parse_config

CONFIG = """
[llm_clients.api]
base_url = "https://api.example.test/"
api_key_env = "KEY"
auth = "x-api-key"
models = ["claude-opus-5"]
[llm_clients.gcp]
kind = "vertex"
vertex = { project = "p", region = "us-east5" }
models = { "claude-opus-5" = "claude-opus-5@20260101" }
"""
BODY = b'{"model": "claude-opus-5", "max_tokens": 8, "messages": []}'


async def test_an_api_account_sends_the_body_as_it_is_with_its_key() -> None:
    api = build_accounts(parse_config(CONFIG), {"KEY": "sk-secret"})["api"]
    outbound = await api.outbound("/v1/messages", BODY, [("content-type", "application/json")])
    assert outbound.url == "https://api.example.test/v1/messages"
    assert outbound.headers == [("content-type", "application/json"), ("x-api-key", "sk-secret")]
    assert outbound.body == BODY
    assert "sk-secret" not in repr(outbound)
    assert "<redacted>" in repr(outbound)


def test_a_vertex_account_has_its_regional_host_and_no_url_without_the_body() -> None:
    gcp = build_accounts(parse_config(CONFIG), {"KEY": "k"})["gcp"].for_model("claude-opus-5")
    assert gcp.kind == "vertex"
    assert gcp.base_url == "https://us-east5-aiplatform.googleapis.com"
    assert gcp.auth_headers() == []
    with pytest.raises(ValueError, match="outbound"):
        gcp.url("/v1/messages")
    assert gcp.cloud is not None
    envelope = gcp.cloud.cloud.envelope("/v1/messages", BODY, model=gcp.provider_model)
    assert json.loads(envelope.body)["anthropic_version"] == "vertex-2023-10-16"


def test_the_answer_helpers_map_a_clouds_errors_and_leave_an_api_accounts() -> None:
    accounts = build_accounts(parse_config(CONFIG), {"KEY": "k"})
    google = b'{"error": {"code": 429, "message": "Quota", "status": "RESOURCE_EXHAUSTED"}}'
    assert accounts["api"].error_answer(429, google) == (429, google)
    status, body = accounts["gcp"].error_answer(429, google)
    assert status == 429
    assert json.loads(body)["error"]["type"] == "rate_limit_error"
    for account in accounts.values():
        assert account.stream_translator("text/event-stream") is None
