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

from extproc_helpers import answered, request_body, request_headers, response_headers, sets
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


async def _both_ways(config: str, steps: list[ep.ProcessingRequest]) -> list[list[object]]:
    """Each of `steps` answered by a fresh stream twice: every message by `answer`, then
    the request bodies by `answer_body` (as the transport hands them on); what each gave
    (one that waits: awaited, and marked so), and whether the stream closed after it."""
    ways = []
    for by_body in (False, True):
        stream, seen = _stream(config), []
        for step in steps:
            if by_body and step.WhichOneof("request") == "request_body":
                answer = stream.answer_body(step.request_body.body)
            else:
                answer = stream.answer(step)
            if isinstance(answer, ep.ProcessingResponse):
                seen.append((answer, stream.closed))
            else:
                waited = await asyncio.wait_for(answered(answer), 5)
                seen.append(("waited", waited, stream.closed))
        ways.append(seen)
    return ways


@pytest.mark.parametrize(
    ("config", "steps"),
    [
        (ACCOUNTS, [request_headers(), _body("m")]),
        (ACCOUNTS + CANARY, [request_headers(), _body("m", user="a conversation")]),
        (ACCOUNTS, [request_headers(), request_body(b"{")]),  # refused: the last phase
        (ACCOUNTS, [_body("m")]),  # before the headers
        (ACCOUNTS, [request_headers(), _body("m"), _body("m")]),  # twice
        (ACCOUNTS, [request_headers(), request_body(b"{"), _body("m")]),  # after the end
        (ACCOUNTS, [request_headers(), response_headers(200), _body("m")]),  # after the answer
        (ACCOUNTS, [request_headers(path="/v1/other"), _body("m")]),  # headers not read
        (ACCOUNTS + JUDGED, [request_headers(), _body("auto")]),  # waits for its judge
        (ACCOUNTS, [request_headers(), request_body(b"")]),
    ],
    ids=[
        "placed",
        "canaried",
        "refused",
        "early",
        "twice",
        "after the end",
        "after the answer",
        "not read",
        "judged",
        "empty",
    ],
)
async def test_a_body_taken_as_its_bytes_answers_as_its_message_does(
    config: str, steps: list[ep.ProcessingRequest]
) -> None:
    by_message, by_body = await _both_ways(config, steps)
    assert by_body == by_message


@pytest.mark.parametrize(
    "before",
    [
        [],
        [request_headers(), _body("m")],
        [request_headers(), request_body(b"{")],
        [request_headers(), response_headers(200)],
        [request_headers(path="/v1/other")],
    ],
    ids=["before the headers", "twice", "after the end", "after the answer", "headers not read"],
)
async def test_a_body_out_of_order_changes_nothing(before: list[ep.ProcessingRequest]) -> None:
    """Envoy sends each phase once, in order: a body that comes out of it is answered
    unchanged and starts no second flight, whichever way it is handed on."""
    for take in ("answer", "answer_body"):
        stream = _stream(ACCOUNTS)
        for step in before:
            stream.answer(step)
        flight = stream.flight
        body = _body("m")
        if take == "answer":
            answer = stream.answer(body)
        else:
            answer = stream.answer_body(body.request_body.body)
        assert answer == ep.ProcessingResponse(request_body=ep.BodyResponse()), take
        assert stream.flight is flight
