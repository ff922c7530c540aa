"""Under a real Envoy, a decision record names the request by the `x-request-id` Envoy gave it
(the one the provider saw), though the refusal is recorded on another ext_proc stream than the
request's router-level one (the upstream-level filter's)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from test_envoy_live import http, message, otlp, rig

from envoy_rig import Rig
from switchyard_mw.telemetry import logs
from switchyard_mw.testing import Behaviour

__all__ = ["http", "otlp", "rig"]  # fixtures, used by name
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration]


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record.__dict__)


@pytest.fixture
def records() -> Iterator[list[dict[str, Any]]]:
    handler = Records()
    root = logging.getLogger(logs.ROOT)
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield handler.records
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


@pytest.mark.parametrize("sent", [None, "client-rid-7"])
async def test_a_refusals_record_carries_envoys_request_id(
    rig: Rig, http: httpx.AsyncClient, records: list[dict[str, Any]], sent: str | None
) -> None:
    rig.configure()
    rig.mock.set_behaviour("key-a", Behaviour(status=401))
    headers = {} if sent is None else {"x-request-id": sent}
    answer = await http.post("/v1/messages", json=message("claude-haiku-5"), headers=headers)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-switchyard-account"] == "key-b"
    first, second = rig.mock.requests
    request_id = first.headers["x-request-id"]
    assert second.headers["x-request-id"] == request_id  # Envoy's retry: the same request
    (cooled,) = [r for r in records if r.get("event") == "account.cooled"]
    assert (cooled["account"], cooled["cause"]) == ("key-a", "credentials")
    assert cooled["request_id"] == request_id
