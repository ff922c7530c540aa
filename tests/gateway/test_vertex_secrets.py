"""A Vertex account's token and key appear in no span, log record or error: a request through
the stack and the forwarding app in process, the mock (its token endpoint too) on uvicorn."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from starlette.applications import Starlette
from starlette.routing import Route

from servers import serve_in_thread
from switchyard_mw.asgi.stack import switchyard_stack
from switchyard_mw.clients.outbound import make_http_client
from switchyard_mw.config import parse_config
from switchyard_mw.gateway import WIRE_ROUTES, Forwarder
from switchyard_mw.testing import Behaviour, MockProvider
from vertex_accounts import EMAIL, service_account_file

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("status", [200, 429, 403])
async def test_no_span_or_log_record_carries_the_token_or_the_key(
    tmp_path: Path,
    otel_spans: InMemorySpanExporter,
    caplog: pytest.LogCaptureFixture,
    status: int,
) -> None:
    caplog.set_level(logging.DEBUG)
    mock = MockProvider()
    mock.set_behaviour(EMAIL, Behaviour(status=status, headers={}))
    with serve_in_thread(mock) as url:
        key_file = service_account_file(tmp_path, mock, url)
        config = parse_config(
            f"""
[llm_clients.gcp]
kind = "vertex"
base_url = "{url}"
vertex = {{ project = "p", region = "us-east5", credentials_file = "{key_file}" }}
models = {{ "claude-opus-5" = "claude-opus-5@1" }}
"""
        )
        upstream = make_http_client()
        forwarder = Forwarder(upstream)
        app = Starlette(routes=[Route(p, forwarder, methods=["POST"]) for p in WIRE_ROUTES])
        stack = switchyard_stack(app, config=config)
        body = {
            "model": "claude-opus-5",
            "max_tokens": 5,
            "messages": [{"role": "user", "content": "hi"}],
        }
        transport = httpx.ASGITransport(app=stack)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            answer = await client.post("/v1/messages", json=body)
        await stack.aclose()
        await upstream.aclose()
    # A refused key is never the client's 403: the credential 503 (design, fourth round).
    assert answer.status_code == (503 if status == 403 else status)
    token = mock.requests[-1].headers["authorization"].removeprefix("Bearer ")
    assert token.startswith("ya29.mock-")
    private_key = key_file.read_text().split("-----")[2][:40]  # a piece of the key itself
    seen = [answer.text, caplog.text]
    for span in otel_spans.get_finished_spans():
        seen += [str(v) for v in (span.attributes or {}).values()]
        seen += [str(event.attributes) for event in span.events]
    assert any("rawPredict" in text for text in seen)  # the upstream call's span is there
    for text in seen:
        assert token not in text
        assert private_key not in text
