"""The router places a request's body at once when nothing it asks takes waiting.

Placing a body may wait on a judge (a request naming a judged route), a tenant's store (any
`[tenants]` config) or a shared store's probe claim; without any of them it is a plain call,
so the transport answers it in the read's own callback with no task (`h2_stream.Handler`).
What the answer says is the same either way: the same cluster, credential and deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import msgspec
import pytest

from extproc_helpers import answered, request_body, request_headers, sets
from switchyard_mw._protos.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from switchyard_mw.accounts import build_accounts
from switchyard_mw.config import parse_config
from switchyard_mw.extproc import ExtProcServicer, Policies
from switchyard_mw.extproc.router import RouterStream

ACCOUNTS = """
[llm_clients.a]
base_url = "https://prov.example"
api_key_env = "KEY_A"
models = ["m", "m-canary"]
envoy_cluster = "prov"

[llm_clients.judge]
base_url = "http://127.0.0.1:9"
api_key_env = "KEY_J"
models = ["j"]
"""
JUDGED = """
[routes.auto]
classifier = "llm"
judge = "judge"
judge_model = "j"
judge_deadline_ms = 50
choices = { simple = "m" }
fallback = "m"
"""
CANARY = """
[canaries.m]
variants = { "m-canary" = 50.0 }
"""
TENANTS = """
[tenants.team]
keys_env = "TEAM_KEYS"
limits = [{ requests = 3, per = "day" }]
"""
ENV = {"KEY_A": "ka", "KEY_J": "kj", "TEAM_KEYS": "sk-team"}


def _stream(config: str) -> RouterStream:
    parsed = parse_config(config)
    policies = Policies(parsed, build_accounts(parsed, ENV), environ=ENV)
    stream = ExtProcServicer(policies).open(())
    assert isinstance(stream, RouterStream)
    return stream


def _body(model: str, user: str = "hi") -> ep.ProcessingRequest:
    text = {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": user}]}
    return request_body(msgspec.json.encode(text))


def _placed_at_once(stream: RouterStream, body: ep.ProcessingRequest) -> ep.ProcessingResponse:
    first = stream.answer(request_headers())
    assert isinstance(first, ep.ProcessingResponse)
    placed = stream.answer(body)
    assert isinstance(placed, ep.ProcessingResponse), placed
    return placed


def _credential(answer: ep.ProcessingResponse) -> Mapping[str, bytes]:
    set_ = sets(answer)
    return {k: v for k, v in set_.items() if k in ("x-switchyard-cluster", "authorization")}


async def test_a_plain_request_is_placed_at_once() -> None:
    answer = _placed_at_once(_stream(ACCOUNTS), _body("m"))
    assert _credential(answer) == {"x-switchyard-cluster": b"prov", "authorization": b"Bearer ka"}
    assert sets(answer)["x-envoy-upstream-rq-per-try-timeout-ms"] == b"60000"
    assert answer.request_body.response.clear_route_cache


async def test_a_canaried_request_is_placed_at_once_on_its_variant() -> None:
    """The variant is chosen in the same call: some conversation of a 50/50 split lands on
    the canary, every one lands on a model `a` serves."""
    models = set()
    for n in range(40):
        stream = _stream(ACCOUNTS + CANARY)
        _placed_at_once(stream, _body("m", user=f"conversation {n}"))
        assert stream.flight is not None
        models.add(stream.flight.ctx.resolved_model)
    assert models == {"m", "m-canary"}


async def test_a_request_for_a_plain_model_beside_a_judged_route_is_placed_at_once() -> None:
    answer = _placed_at_once(_stream(ACCOUNTS + JUDGED), _body("m"))
    assert _credential(answer)["x-switchyard-cluster"] == b"prov"


async def test_a_judged_route_waits_for_its_judge_and_then_places_the_request() -> None:
    """The judge (unreachable here) is asked in a task the transport awaits; it fails open
    to the route's fallback."""
    stream = _stream(ACCOUNTS + JUDGED)
    stream.answer(request_headers())
    placing = stream.answer(_body("auto"))
    assert not isinstance(placing, ep.ProcessingResponse)
    answer = await asyncio.wait_for(answered(placing), 5)
    assert answer is not None
    assert _credential(answer)["x-switchyard-cluster"] == b"prov"
    assert stream.flight is not None
    assert stream.flight.ctx.resolved_model == "m"


async def test_a_tenants_request_waits_for_its_admission() -> None:
    stream = _stream(ACCOUNTS + TENANTS)
    stream.answer(request_headers(extra={"x-api-key": "sk-team"}))
    placing = stream.answer(_body("m"))
    assert not isinstance(placing, ep.ProcessingResponse)
    answer = await answered(placing)
    assert answer is not None
    assert sets(answer)["x-switchyard-cluster"] == b"prov"


@pytest.mark.parametrize("body", [b"{", b'{"model": 5, "messages": []}'])
async def test_a_body_refused_is_answered_at_once(body: bytes) -> None:
    stream = _stream(ACCOUNTS)
    stream.answer(request_headers())
    answer = stream.answer(request_body(body))
    assert isinstance(answer, ep.ProcessingResponse)
    assert answer.immediate_response.status.code == 400
    assert stream.closed  # the refusal is the last phase
