"""The per-try timeout under Envoy when the accounts a request's tries may reach have different
bounds (`Policies.reach`, `Policies.deadline_headers`).

Envoy's router reads `x-envoy-upstream-rq-per-try-timeout-ms` once, at routing, and keeps it
for every try of the request: set to the first account's bound, a retry on an account with a
longer one would be cut before its own bound (measured through Envoy 1.40 before this: the
client got a 504 after about 1.1 s, the second account charged a fault, where the ASGI front
waits for it). So the per-try timeout is the longest time to start among the accounts the
request's tries may go to, and each try's own bound is the processor's (the first-token
filter's timer): tests/extproc/test_envoy_first_token_live.py shows it through Envoy. A whole
(JSON) answer's per-try timeout is the longest time to be whole among them, so a try whose
answer is late is retried on the next account as through the ASGI front, and the route timeout
bounds two such tries (tests/extproc/test_envoy_live.py).
"""

from __future__ import annotations

import msgspec
import pytest

from extproc_helpers import (
    Stream,
    request_body,
    request_headers,
    response_headers,
    sets,
    upstream_headers,
)
from switchyard_mw.accounts import build_accounts
from switchyard_mw.config import parse_config
from switchyard_mw.engine.attempts import deadline_secs, start_secs
from switchyard_mw.extproc import ExtProcServicer, Policies
from switchyard_mw.wire import Wire, read_request

PER_TRY = "x-envoy-upstream-rq-per-try-timeout-ms"
TOTAL = "x-envoy-upstream-rq-timeout-ms"


def _account(name: str, cluster: str, priority: int, extra: str, models: str = '["m"]') -> str:
    return f"""
[llm_clients.{name}]
base_url = "https://{cluster}.example"
api_key_env = "KEY"
models = {models}
priority = {priority}
envoy_cluster = "{cluster}"
{extra}
"""


CONFIG = (
    _account("a1", "prov", 0, "first_token_secs = 0.5", '["m", "solo", "chained"]')
    # A whole answer may take it longer than a1 (its timeout_secs, 90 s against 60 s).
    + _account("a2", "prov", 1, "first_token_secs = 2\ntimeout_secs = 90")
    # Its time to start is its timeout_secs, sooner than its first_token_secs.
    + _account("b", "other", 2, "first_token_secs = 5\ntimeout_secs = 3")
    # On a cluster no aggregate of prov's reaches: never one of the request's tries.
    + _account("far", "far", 3, "first_token_secs = 30")
    # Serves only the chain's model, on the other provider.
    + _account("c", "other", 4, "first_token_secs = 7", '["m-big"]')
    + """
[fallbacks]
chained = { models = ["m-big"], on = ["unavailable"] }
"""
)
ACROSS = CONFIG + '\n[server.envoy_failover]\n"prov-then-other" = ["prov", "other"]\n'
ALIKE = _account("a1", "prov", 0, "first_token_secs = 0.5") + _account("a2", "prov", 1, "")
RID = "rid-start-reach"


def policies(text: str) -> Policies:
    config = parse_config(text)
    return Policies(config, build_accounts(config, {"KEY": "k"}))


@pytest.mark.parametrize(
    ("text", "model", "reach"),
    [
        # The other key of the cluster takes the retries: its 2 s.
        (CONFIG, "m", 2.0),
        # Through the aggregate, the other provider's b too: its timeout_secs, 3 s (its
        # first_token_secs is later); never `far`'s 30 s, a cluster the request cannot reach.
        (ACROSS, "m", 3.0),
        # Served by a1 alone: its own bound.
        (ACROSS, "solo", 0.5),
        # A model of its chain on the other provider is tried there: c's 7 s.
        (ACROSS, "chained", 7.0),
    ],
)
def test_the_reach_is_the_longest_start_among_the_accounts_tries_may_go_to(
    text: str, model: str, reach: float
) -> None:
    view = read_request(Wire.ANTHROPIC, _stream(model))
    assert policies(text).reach("a1", model).secs(view) == reach


@pytest.mark.parametrize(
    ("text", "max_tokens", "reach"),
    [
        # a2's timeout_secs (90 s) against a1's 60 s.
        (CONFIG, 100, 90.0),
        # b's 3 s adds nothing; an output cap that needs longer grows every account's bound
        # (max(timeout_secs, min(600, max_tokens * 3600 / 128000)) = 360 s).
        (ACROSS, 100, 90.0),
        (ACROSS, 12800, 360.0),
        # Accounts alike (the usual config): no try's bound is longer than the first's own,
        # which the per-try timeout then is (0: nothing to add, nothing computed).
        (ALIKE, 12800, 0.0),
    ],
)
def test_a_whole_answers_reach_is_the_longest_time_to_be_whole(
    text: str, max_tokens: int, reach: float
) -> None:
    view = read_request(Wire.ANTHROPIC, _json("m", max_tokens))
    assert policies(text).reach("a1", "m").secs(view) == reach


def _stream(model: str) -> bytes:
    question = [{"role": "user", "content": "hi"}]
    body = {"model": model, "max_tokens": 8, "messages": question, "stream": True}
    return msgspec.json.encode(body)


def _json(model: str, max_tokens: int) -> bytes:
    question = [{"role": "user", "content": "hi"}]
    return msgspec.json.encode({"model": model, "max_tokens": max_tokens, "messages": question})


async def _routed(
    servicer: ExtProcServicer, body: bytes, extra: dict[str, str] | None = None
) -> tuple[Stream, dict[str, bytes]]:
    router = Stream(servicer)
    await router.send(request_headers(extra={"x-request-id": RID, **(extra or {})}))
    return router, sets(await router.send(request_body(body)))


async def test_a_streams_per_try_timeout_leaves_room_for_every_try() -> None:
    servicer = ExtProcServicer(policies(ACROSS))
    router, routed = await _routed(servicer, _stream("m"))
    assert routed["authorization"] == b"Bearer k"
    assert routed[PER_TRY] == b"3000"  # b's, not a1's 500
    assert TOTAL not in routed
    flight = servicer.flights.find(RID)
    assert flight is not None
    # What bounds a1's own try (and what its answer reports): a1's 0.5 s.
    assert flight.ctx.attempt_deadline_secs == 0.5
    await router.close()


async def test_a_budget_still_cuts_the_per_try_timeout() -> None:
    servicer = ExtProcServicer(policies(ACROSS))
    router, routed = await _routed(servicer, _stream("m"), {"x-switchyard-timeout-ms": "1000"})
    assert 900 <= int(routed[PER_TRY]) <= 1000
    assert 900 <= int(routed[TOTAL]) <= 1000
    await router.close()


async def test_a_whole_answers_try_is_timed_out_to_be_retried() -> None:
    """Its per-try timeout: the longest time to be whole among the accounts its tries may go
    to (a2's 90 s); the route timeout two such tries (one timed out, the one after it)."""
    servicer = ExtProcServicer(policies(ACROSS))
    router, routed = await _routed(servicer, _json("m", 100))
    assert routed[PER_TRY] == b"90000"
    assert routed[TOTAL] == b"180000"
    flight = servicer.flights.find(RID)
    assert flight is not None
    assert flight.ctx.attempt_deadline_secs == 60.0  # a1's own, what its answer reports
    await router.close()
    router, routed = await _routed(servicer, _json("m", 100), {"x-switchyard-timeout-ms": "1000"})
    assert 900 <= int(routed[PER_TRY]) <= 1000
    assert 900 <= int(routed[TOTAL]) <= 1000
    await router.close()


async def test_the_retry_is_bound_by_its_own_account() -> None:
    """After Envoy's retry the attempt's bound is the retry's account's: what the first-token
    filter holds its content to, and what `x-switchyard-deadline-ms` reports."""
    servicer = ExtProcServicer(policies(CONFIG))
    router, _ = await _routed(servicer, _stream("m"))
    refused = Stream(servicer, [("x-switchyard-filter", "upstream")])
    answer = await refused.send(response_headers(503, request_id=RID))
    assert sets(answer)["x-switchyard-retry"] == b"1"
    await refused.close()
    retry = Stream(servicer, [("x-switchyard-filter", "upstream")])
    await retry.send(upstream_headers({"x-request-id": RID}, attempt=2))
    await retry.close()
    flight = servicer.flights.find(RID)
    assert flight is not None
    assert flight.ctx.account is not None
    assert flight.ctx.account.name == "a2"
    assert flight.ctx.attempt_deadline_secs == 2.0
    await router.close()


def test_a_streams_first_bound_is_its_time_to_start() -> None:
    """`attempts.deadline_secs` writes `start_secs` out (a call fewer on every attempt): the
    two agree for every account of the config."""
    view = read_request(Wire.ANTHROPIC, _stream("m"))
    accounts = policies(ACROSS).accounts
    for account in accounts.values():
        assert deadline_secs(view, account.spec) == start_secs(account.spec)
