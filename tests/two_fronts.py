"""What the two-front comparisons (tests/engine/test_two_fronts*.py) read of a request's
answer and telemetry, in terms both fronts can say: `Decisions`, and the readers that fill it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from extproc_helpers import common, removes, sets
from switchyard_mw.telemetry import names as tm


@dataclass
class Decisions:
    """What a front decided for one request, in terms both fronts can say."""

    status: int
    error: tuple[str, str] | None = None
    """(type, message) of switchyard's own error answer."""
    headers: dict[str, str] = field(default_factory=dict)
    """`x-switchyard-*`, `retry-after` and `x-should-retry`."""
    attempts: list[tuple[str, dict[str, Any], str]] = field(default_factory=list)
    """Each attempt span: name, attributes (but `error.type`), status code."""
    calls: list[tuple[str, Any, str]] = field(default_factory=list)
    """Each attempt's GenAI CLIENT span (`chat {model}`): name, `error.type`, status code."""
    sent: list[tuple[str, str]] = field(default_factory=list)
    """Each attempt's (key, `model` of the body the upstream got)."""


async def post_through(
    stack: Any, upstream: httpx.AsyncClient, body: bytes, content_type: str = "application/json"
) -> httpx.Response:
    """The ASGI front's answer to `body` posted to /v1/messages through `stack`; the stack and
    its forwarding app's `upstream` client are closed after it."""
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=stack), base_url="http://gw.test"
    ) as client:
        reply = await client.post(
            "/v1/messages", content=body, headers={"content-type": content_type}
        )
    await stack.aclose()
    await upstream.aclose()
    return reply


UPSTREAM_ID = "x-switchyard-upstream-request-id"


def kept_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """`x-switchyard-*`, `retry-after` and `x-should-retry`; the provider's request id by its
    presence (the mock makes a new one for each request)."""
    kept = {
        k: v
        for k, v in headers.items()
        if k.startswith("x-switchyard-") or k in ("retry-after", "x-should-retry")
    }
    if UPSTREAM_ID in kept:
        kept[UPSTREAM_ID] = "(the provider's)"
    return kept


def attempt_spans(spans: InMemorySpanExporter) -> list[tuple[str, dict[str, Any], str]]:
    found = sorted(
        (s for s in spans.get_finished_spans() if s.name == tm.SPAN_ATTEMPT),
        key=lambda s: s.start_time or 0,
    )
    return [
        (
            s.name,
            {k: v for k, v in (s.attributes or {}).items() if k != tm.ERROR_TYPE},
            s.status.status_code.name,
        )
        for s in found
    ]


def client_spans(spans: InMemorySpanExporter) -> list[tuple[str, Any, str]]:
    found = sorted(
        (s for s in spans.get_finished_spans() if s.name.startswith("chat ")),
        key=lambda s: s.start_time or 0,
    )
    return [
        (s.name, (s.attributes or {}).get(tm.ERROR_TYPE), s.status.status_code.name) for s in found
    ]


def error_of(body: Any) -> tuple[str, str]:
    error = body["error"]
    return error["type"], error["message"]


def decoded(headers: Mapping[str, bytes]) -> dict[str, str]:
    return {k: v.decode() for k, v in headers.items()}


@dataclass
class Outgoing:
    """One attempt's request as Envoy sends it upstream, as the filters' answers made it."""

    headers: dict[str, str]
    body: bytes

    def apply(self, answer: Any) -> None:
        """An upstream filter's answer to the request's headers or body."""
        change = common(answer)
        for name in removes(answer):
            self.headers.pop(name, None)
        self.headers.update(decoded(sets(answer)))
        if change.body_mutation.clear_body:
            self.body = b""
        elif change.body_mutation.body:
            self.body = change.body_mutation.body


@dataclass
class Answer:
    """An upstream's answer as Envoy passes it on (the filters may change it)."""

    status: int
    headers: dict[str, str]
    body: bytes


async def send_upstream(mock: httpx.AsyncClient, out: Outgoing) -> Answer:
    """`out` sent as Envoy sends it (to the mock provider in process), its answer read whole."""
    headers = {k: v for k, v in out.headers.items() if not k.startswith(":")}
    headers["host"] = out.headers.get(":authority", "upstream.test")  # what Envoy sends
    reply = await mock.post(out.headers[":path"], content=out.body, headers=headers)
    return Answer(reply.status_code, dict(reply.headers), reply.content)


def refusal_matched(status: int) -> bool:
    """Whether envoy.yaml's matcher sends an answer of `status` to the refusal filter: 400,
    401-403, 429 and 5xx."""
    return status in (400, 401, 402, 403, 429) or status >= 500


def text_of(body: bytes) -> str:
    """The text an Anthropic answer carries: a JSON message's, or an SSE stream's deltas."""
    if body.startswith(b"{"):
        message = msgspec.json.decode(body)
        return "".join(block.get("text", "") for block in message.get("content", []))
    text = ""
    for line in body.decode().splitlines():
        if line.startswith("data: ") and "text_delta" in line:
            text += msgspec.json.decode(line[6:])["delta"]["text"]
    return text
