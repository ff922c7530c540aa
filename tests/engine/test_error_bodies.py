"""Billing refusals read from an error answer's body, on every wire and account kind.

A provider says "this account has no credit or quota left" with a status that means
something else: OpenAI's 429 `insufficient_quota` (Chat and Responses), Anthropic's 400
`invalid_request_error` "Your credit balance is too low". The cloud kinds say it with a status
that already is a credential refusal (Vertex's 403 `BILLING_DISABLED`, Bedrock's 403
`AccessDeniedException`), or pass the model's own Anthropic-shaped answer through as it is.
"""

from __future__ import annotations

import gzip
import json

import msgspec
import pytest

from switchyard_mw.accounts import Account, build_accounts
from switchyard_mw.config import parse_config
from switchyard_mw.core.pool import CREDENTIAL_STATUSES, Outcome, classify_status
from switchyard_mw.engine.error_bodies import MAX_BODY, billing_refusal, context_refusal
from switchyard_mw.testing._wire_replies import billing_body, context_length_body

WIRES = ["/v1/messages", "/v1/chat/completions", "/v1/responses"]


@pytest.mark.parametrize("path", WIRES)
def test_each_wire_s_billing_refusal_as_the_api_sends_it(path: str) -> None:
    status, body = billing_body(path)
    assert status == (400 if path == "/v1/messages" else 429)
    assert billing_refusal(status, body)
    assert billing_refusal(status, gzip.compress(body))  # a CDN's gzip-encoded answer
    assert not context_refusal(status, body)


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (
            429,
            {
                "error": {
                    "message": "Rate limit reached",
                    "type": "requests",
                    "code": "rate_limit_exceeded",
                }
            },
        ),
        (429, {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}),
        (
            400,
            {
                "type": "error",
                "error": {"type": "invalid_request_error", "message": "roles must alternate"},
            },
        ),
        (400, {"error": {"type": "insufficient_quota", "code": "insufficient_quota"}}),
        (
            403,
            {
                "type": "error",
                "error": {
                    "type": "invalid_request_error",
                    "message": "Your credit balance is too low",
                },
            },
        ),
        (
            400,
            {
                "type": "error",
                "error": {"type": "api_error", "message": "Your credit balance is too low"},
            },
        ),
    ],
    ids=[
        "openai rate limit",
        "anthropic rate limit",
        "anthropic client error",
        "insufficient_quota on a 400",
        "credit text on a 403 (a key fault by its status already)",
        "credit text in another error type",
    ],
)
def test_what_is_no_billing_refusal(status: int, body: object) -> None:
    assert not billing_refusal(status, msgspec.json.encode(body))


def test_the_body_is_read_within_its_bound() -> None:
    _, body = billing_body("/v1/chat/completions")
    padded = body[:-1] + b',"x":"' + b"y" * MAX_BODY + b'"}'
    assert not billing_refusal(429, padded)
    assert not billing_refusal(429, gzip.compress(padded))  # inflated no further either
    assert not billing_refusal(429, b"not json")
    assert not billing_refusal(429, b"")
    assert context_refusal(400, context_length_body("/v1/messages", 210_000))


CLOUDS = """
[llm_clients.gcp]
kind = "vertex"
vertex = { project = "p", region = "us-east5" }
models = { "claude-opus-5" = "claude-opus-5@20260101" }

[llm_clients.aws]
kind = "bedrock"
bedrock = { region = "us-east-1" }
models = { "claude-opus-5" = "anthropic.claude-opus-5-v1:0" }
"""


def _clouds() -> dict[str, Account]:
    return {
        name: account.for_model("claude-opus-5")
        for name, account in build_accounts(parse_config(CLOUDS), {}).items()
    }


def test_a_vertex_account_s_billing_refusals() -> None:
    gcp = _clouds()["gcp"]
    # The model's own answer passes through as Anthropic's: read as on the API.
    status, body = billing_body("/v1/messages")
    assert billing_refusal(*gcp.error_answer(status, body))
    # Google's own: billing disabled on the project is a 403, a credential refusal already.
    google = json.dumps(
        {"error": {"code": 403, "message": "Billing disabled", "status": "PERMISSION_DENIED"}}
    ).encode()
    status, _ = gcp.error_answer(403, google)
    assert classify_status(status) is Outcome.FAULT
    assert str(status) in CREDENTIAL_STATUSES


def test_a_bedrock_account_s_billing_refusals() -> None:
    aws = _clouds()["aws"]
    denied = b'{"message":"Model access is denied due to INVALID_PAYMENT_INSTRUMENT."}'
    headers = [(b"x-amzn-errortype", b"AccessDeniedException:http://internal.amazon.com/")]
    status, _ = aws.error_answer(403, denied, headers)
    assert str(status) in CREDENTIAL_STATUSES
    status, body = billing_body("/v1/messages")  # the model's own answer, passed through
    assert billing_refusal(*aws.error_answer(status, body, []))
