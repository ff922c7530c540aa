"""The ext_proc servicer, phase by phase, with synthetic `ProcessingRequest`s.

Each test drives `ExtProcServicer.Process` the way Envoy does: one message, one answer. The
judge is the mock provider in process; the upstream calls are never made (Envoy would).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from extproc_helpers import (
    Stream,
    immediate,
    removes,
    request_body,
    request_headers,
    response_body,
    response_headers,
    sets,
    upstream_headers,
)
from switchyard_mw._protos.envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from switchyard_mw.accounts import build_accounts
from switchyard_mw.config import parse_config
from switchyard_mw.core.pool import BreakerState, Outcome
from switchyard_mw.extproc import ExtProcServicer, Policies
from switchyard_mw.telemetry import names as tm
from switchyard_mw.testing import Behaviour, MockProvider

CONFIG = """
[llm_clients.a]
base_url = "https://prov.example"
api_key_env = "KEY_A"
auth = "x-api-key"
models = ["m-base", "m-var", "small", "big"]
priority = 0
timeout_secs = 10
failure_threshold = 1
envoy_cluster = "prov"

[llm_clients.b]
base_url = "https://prov.example"
api_key_env = "KEY_B"
models = ["m-base", "m-var", "small", "big"]
priority = 1
timeout_secs = 10
failure_threshold = 1
envoy_cluster = "prov"

[llm_clients.c]
base_url = "https://other.example"
api_key_env = "KEY_C"
models = ["solo"]
envoy_cluster = "other"

[llm_clients.j]
base_url = "http://judge"
models = ["judge-model"]

[canaries."m-base"]
variants = { "m-var" = 100.0 }

[routes.auto]
classifier = "llm"
judge = "j"
judge_model = "judge-model"
judge_deadline_ms = 300
choices = { simple = "small", complex = "big" }
fallback = "big"
"""
ENV = {"KEY_A": "secret-a", "KEY_B": "secret-b", "KEY_C": "secret-c"}
UPSTREAM = [("x-switchyard-filter", "upstream")]


@dataclass
class Env:
    mock: MockProvider
    policies: Policies
    servicer: ExtProcServicer

    def stream(self, metadata: list[tuple[str, str]] | None = None) -> Stream:
        return Stream(self.servicer, metadata or [])


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    mock = MockProvider()
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=mock))
    config = parse_config(CONFIG)
    policies = Policies(config, build_accounts(config, ENV), judge_http_client=http)
    yield Env(mock, policies, ExtProcServicer(policies))
    await http.aclose()


def anthropic(model: str = "m-base", **fields: Any) -> bytes:
    body = {"model": model, "max_tokens": 12800, "metadata": {"user_id": "u1"}, **fields}
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return msgspec.json.encode(body)


async def routed(env: Env, body: bytes, extra: dict[str, str] | None = None) -> tuple[Stream, Any]:
    stream = env.stream()
    await stream.send(request_headers(extra=extra))
    return stream, await stream.send(request_body(body))


# --- request headers -------------------------------------------------------------------------


async def test_client_routing_and_envoy_control_headers_are_removed(env: Env) -> None:
    stream = env.stream()
    forged = {
        "x-switchyard-cluster": "internal-admin",
        "x-switchyard-hedge": "1",  # would pick the hedge route: Envoy's hedge on its own
        "x-envoy-upstream-rq-timeout-ms": "99999999",
        "x-envoy-retry-on": "5xx",
    }
    answer = await stream.send(request_headers(extra=forged))
    assert set(forged) <= set(removes(answer))
    await stream.close()


async def test_other_requests_pass_through_but_lose_the_routing_header(env: Env) -> None:
    stream = env.stream()
    get = request_headers("/healthz", {":method": "GET", "x-switchyard-cluster": "x"}, end=True)
    answer = await stream.send(get)
    assert removes(answer) == ["x-switchyard-cluster", "x-switchyard-hedge"]
    mode = processing_mode_pb2.ProcessingMode
    assert answer.mode_override.request_body_mode == mode.NONE
    assert answer.mode_override.response_header_mode == mode.SKIP
    await stream.close()


async def test_the_models_list_and_other_v1_paths_are_answered_at_the_request_headers(
    env: Env,
) -> None:
    versioned = {":method": "GET", "anthropic-version": "2023-06-01"}
    cases = [
        ("/v1/models", {":method": "GET"}, 200, "object"),
        ("/v1/models?limit=1", versioned, 200, "has_more"),
        ("/v1/nope", {":method": "GET"}, 404, "error"),
        ("/v1/nope", versioned, 404, "type"),
    ]
    for path, extra, code, key in cases:
        stream = env.stream()
        status, headers, body = immediate(await stream.send(request_headers(path, extra, end=True)))
        assert (status, headers["content-type"]) == (code, b"application/json")
        assert key in body, body
        await stream.close()
    # An LLM call whose body is not JSON still passes through unread.
    stream = env.stream()
    plain = request_headers("/v1/messages", {"content-type": "text/plain"})
    assert removes(await stream.send(plain)) == ["x-switchyard-cluster", "x-switchyard-hedge"]
    await stream.close()


# --- request body: route, rewrite, credential, deadline --------------------------------------


async def test_the_body_phase_routes_rewrites_and_sets_the_credential(env: Env) -> None:
    stream, answer = await routed(
        env, anthropic(), {"authorization": "Bearer caller", "x-switchyard-cluster": "evil"}
    )
    mutation = answer.request_body.response
    assert mutation.clear_route_cache
    new_body = mutation.body_mutation.body
    assert msgspec.json.decode(new_body)["model"] == "m-var"  # the canary variant
    headers = sets(answer)
    assert headers["content-length"] == str(len(new_body)).encode()
    assert headers["x-switchyard-cluster"] == b"prov"  # the account's cluster, not the client's
    assert headers["x-api-key"] == b"secret-a"
    assert {"authorization", "x-api-key"} <= set(removes(answer))
    # max(10, min(600, 12800 * 3600 / 128000)) = 360 s a try (the route retries a try late
    # past it), and two tries for the request (tests/extproc/test_start_reach.py)
    assert headers["x-envoy-upstream-rq-per-try-timeout-ms"] == b"360000"
    assert headers["x-envoy-upstream-rq-timeout-ms"] == b"720000"
    assert not any(name.startswith("x-switchyard-t") for name in headers)  # no ticket any more
    assert len(env.servicer.flights) == 1  # found by the request's x-request-id
    await stream.close()
    assert len(env.servicer.flights) == 0


async def test_an_incoming_budget_only_shortens_the_envoy_timeout(env: Env) -> None:
    stream, answer = await routed(env, anthropic(), {"x-switchyard-timeout-ms": "1500"})
    assert 1400 <= int(sets(answer)["x-envoy-upstream-rq-timeout-ms"]) <= 1500
    assert 1400 <= int(sets(answer)["x-envoy-upstream-rq-per-try-timeout-ms"]) <= 1500
    await stream.close()
    stream, answer = await routed(env, anthropic(), {"x-switchyard-timeout-ms": "9999999"})
    assert sets(answer)["x-envoy-upstream-rq-timeout-ms"] == b"720000"
    await stream.close()


async def test_a_stream_must_start_in_time_but_has_no_total_timeout(env: Env) -> None:
    stream, answer = await routed(env, anthropic(stream=True))
    assert sets(answer)["x-envoy-upstream-rq-per-try-timeout-ms"] == b"10000"  # timeout_secs
    assert "x-envoy-upstream-rq-timeout-ms" not in sets(answer)
    await stream.close()
    stream, answer = await routed(env, anthropic(stream=True), {"x-switchyard-timeout-ms": "5000"})
    assert 4900 <= int(sets(answer)["x-envoy-upstream-rq-per-try-timeout-ms"]) <= 5000
    assert 4900 <= int(sets(answer)["x-envoy-upstream-rq-timeout-ms"]) <= 5000
    await stream.close()


async def test_a_model_no_routable_account_serves_passes_untouched(env: Env) -> None:
    # Account `j` serves it, but has no Envoy cluster to route to.
    stream, answer = await routed(env, anthropic("judge-model"))
    assert not answer.request_body.response.HasField("header_mutation")
    assert not answer.request_body.response.HasField("body_mutation")
    await stream.close()


@pytest.mark.parametrize(
    ("path", "error_type"),
    [("/v1/messages", "not_found_error"), ("/v1/chat/completions", "model_not_found")],
)
async def test_a_model_no_account_serves_is_a_404_naming_it(
    env: Env, path: str, error_type: str
) -> None:
    stream = env.stream()
    await stream.send(request_headers(path=path))
    status, _, body = immediate(await stream.send(request_body(anthropic("no-such-model"))))
    assert status == 404
    error = body["error"]
    assert error["type"] == error_type
    assert "`no-such-model`" in error["message"]
    assert env.mock.requests == []  # the judge was not asked either
    await stream.close()


@pytest.mark.parametrize("model", ["m-base\r\nx-evil: 1", "m\u0000", "x" * 100_000])
async def test_a_model_name_unfit_for_a_header_is_a_400_before_any_policy(
    env: Env, model: str
) -> None:
    stream = env.stream()
    await stream.send(request_headers())
    status, headers, body = immediate(await stream.send(request_body(anthropic(model))))
    assert status == 400
    assert body["error"]["type"] == "invalid_request_error"
    assert all(len(value) < 1000 and b"\n" not in value for value in headers.values())
    assert env.mock.requests == []
    await stream.close()


# --- immediate responses in the wire's error format ------------------------------------------


async def test_malformed_json_is_a_400_in_anthropic_format(env: Env) -> None:
    stream = env.stream()
    await stream.send(request_headers())
    status, headers, body = immediate(await stream.send(request_body(b"{nope")))
    assert status == 400
    assert headers["content-type"] == b"application/json"
    assert body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    await stream.close()


async def test_a_body_over_the_limit_is_a_413_in_openai_format(env: Env) -> None:
    stream = env.stream()
    too_big = {"content-length": str(64 * 1024 * 1024)}
    status, _, body = immediate(await stream.send(request_headers("/v1/chat/completions", too_big)))
    assert status == 413
    assert body["error"]["type"] == body["error"]["code"] == "request_too_large"
    await stream.close()


async def test_no_healthy_account_is_a_503_with_retry_after(env: Env) -> None:
    # (A model fault cools a two-model account for that model only: the variant's and the
    # base's, or the canary's base would take over.)
    for name in ("a", "b"):
        for model in ("m-var", "m-base"):
            lease = env.policies.pool.acquire(model, allowed={name})
            assert lease is not None
            env.policies.pool.record(lease, Outcome.FAULT)
    stream = env.stream()
    await stream.send(request_headers("/v1/chat/completions"))
    chat = msgspec.json.encode(
        {"model": "m-base", "user": "u1", "messages": [{"role": "user", "content": "hi"}]}
    )
    status, headers, body = immediate(await stream.send(request_body(chat)))
    assert status == 503
    assert body["error"]["type"] == "no_healthy_account"
    assert 1 <= int(headers["retry-after"]) <= 30
    assert headers["x-switchyard-model"] == b"m-var"
    await stream.close()


# --- response headers: outcomes, timeouts, exposed headers -----------------------------------


async def test_the_final_status_is_the_attempts_outcome(env: Env, otel_metrics: Any) -> None:
    stream, _ = await routed(env, anthropic())
    answer = await stream.send(response_headers(503, details="via_upstream"))
    await stream.close()
    assert env.policies.pool.status_of("a", model="m-var").state is BreakerState.COOLED
    exposed = sets(answer)
    assert exposed["x-switchyard-model"] == b"m-var"
    assert exposed["x-switchyard-account"] == b"a"
    assert exposed["x-switchyard-attempts"] == b"1"
    assert exposed["x-switchyard-deadline-ms"] == b"360000"
    assert "x-switchyard-retry" in removes(answer)


async def test_a_final_key_refusal_is_never_the_clients_401(env: Env, otel_metrics: Any) -> None:
    """The final answer (no retry follows) refused the account's key: recorded as such, and
    the client gets the 503 that says the credentials were refused, not the provider's 401."""
    before = otel_metrics.value(tm.ACCOUNT_FAULTS, **{tm.ACCOUNT: "c"}, status="401")
    stream, _ = await routed(env, anthropic("solo"))  # c alone serves it
    answer = await stream.send(response_headers(401, details="via_upstream"))
    await stream.close()
    assert otel_metrics.value(tm.ACCOUNT_FAULTS, **{tm.ACCOUNT: "c"}, status="401") == before + 1
    assert env.policies.pool.status_of("c").consecutive_faults == 1
    status, headers, body = immediate(answer)
    assert status == 503
    assert body["error"]["type"] == "no_healthy_account"
    assert "refused the credentials" in body["error"]["message"]
    assert headers["x-should-retry"] == b"false"
    assert "retry-after" not in headers
    assert headers["x-switchyard-account"] == b"c"
    assert headers["x-switchyard-attempts"] == b"1"


async def test_envoys_timeout_becomes_a_504_deadline_exceeded(env: Env, otel_metrics: Any) -> None:
    before = otel_metrics.value(tm.DEADLINE_EXCEEDED, phase="total")
    stream, _ = await routed(env, anthropic())
    timeout = response_headers(504, {"content-type": "text/plain"}, details="response_timeout")
    status, headers, body = immediate(await stream.send(timeout))
    await stream.close()
    assert status == 504
    assert body["error"]["type"] == "deadline_exceeded"
    assert headers["x-switchyard-account"] == b"a"
    assert otel_metrics.value(tm.DEADLINE_EXCEEDED, phase="total") == before + 1
    assert env.policies.pool.status_of("a", model="m-var").consecutive_faults == 1


async def test_an_upstream_504_is_passed_on_as_the_upstreams(env: Env) -> None:
    stream, _ = await routed(env, anthropic())
    answer = await stream.send(response_headers(504, details="via_upstream"))
    await stream.close()
    assert answer.WhichOneof("response") == "response_headers"


# --- the upstream-level filter: failover inside one request ----------------------------------


async def test_a_refused_key_fails_over_to_the_next_on_the_cluster(
    env: Env, otel_metrics: Any
) -> None:
    """As the example envoy.yaml runs the upstream-level filter: a response-only stream on a
    refused attempt (found by the `request.id` attribute), a request-only one on the retry."""
    failovers = otel_metrics.value(tm.FAILOVERS, **{tm.RESPONSE_MODEL: "m-var"})
    router, _ = await routed(env, anthropic())

    refused = env.stream(UPSTREAM)  # attempt 1's response: a refusal
    retry = await refused.send(response_headers(402, request_id="rid-1"))
    assert sets(retry) == {"x-switchyard-retry": b"1"}
    await refused.close()
    assert env.policies.pool.status_of("a").state is BreakerState.COOLED  # recorded at once

    second = env.stream(UPSTREAM)  # attempt 2's request headers: key b swapped in
    attempt = await second.send(upstream_headers({"x-api-key": "secret-a"}, attempt=2))
    assert sets(attempt) == {"authorization": b"Bearer secret-b"}
    assert {"authorization", "x-api-key"} <= set(removes(attempt))
    await second.close()

    # Attempt 2 succeeded: no upstream-level stream for it; the router-level one records it.
    final = sets(await router.send(response_headers(200, details="via_upstream")))
    await router.close()
    assert final["x-switchyard-account"] == b"b"
    assert final["x-switchyard-attempts"] == b"2"
    assert env.policies.pool.status_of("b").consecutive_faults == 0
    assert otel_metrics.value(tm.FAILOVERS, **{tm.RESPONSE_MODEL: "m-var"}) == failovers + 1
    assert len(env.servicer.flights) == 0


async def test_a_filter_that_sees_every_phase_of_every_attempt_works_too(env: Env) -> None:
    """An upstream-level filter without matchers (every attempt, both phases, and no
    x-envoy-attempt-count): attempt 1's request headers change nothing."""
    router, _ = await routed(env, anthropic())
    first = env.stream(UPSTREAM)
    attempt = await first.send(upstream_headers({}))
    assert sets(attempt) == {}
    assert removes(attempt) == []
    assert sets(await first.send(response_headers(500))) == {"x-switchyard-retry": b"1"}
    await first.close()
    second = env.stream(UPSTREAM)
    attempt = await second.send(upstream_headers({"x-api-key": "secret-a"}))
    assert sets(attempt) == {"authorization": b"Bearer secret-b"}
    assert sets(await second.send(response_headers(200))) == {}
    await second.close()
    final = sets(await router.send(response_headers(200, details="via_upstream")))
    await router.close()
    assert final["x-switchyard-attempts"] == b"2"
    assert env.policies.pool.status_of("a", model="m-var").state is BreakerState.COOLED


async def test_a_429_may_fail_over_but_never_cools(env: Env) -> None:
    router, _ = await routed(env, anthropic())
    upstream = env.stream(UPSTREAM)
    answer = await upstream.send(response_headers(429, request_id="rid-1"))
    assert answer.HasField("mode_override")  # its body says whether it is a billing refusal
    throttled = b'{"type":"error","error":{"type":"rate_limit_error","message":"slow down"}}'
    answer = await upstream.send(response_body(throttled, end=True))
    assert sets(answer) == {"x-switchyard-retry": b"1"}
    await upstream.close()
    await router.close()
    assert env.policies.pool.status_of("a").state is BreakerState.CLOSED
    assert env.policies.pool.status_of("a").consecutive_faults == 0


async def test_no_retry_is_asked_when_no_other_account_shares_the_cluster(env: Env) -> None:
    router, answer = await routed(env, anthropic("solo"))
    assert sets(answer)["x-switchyard-cluster"] == b"other"
    upstream = env.stream(UPSTREAM)
    assert sets(await upstream.send(response_headers(500, request_id="rid-1"))) == {}
    await upstream.close()
    await router.close()


async def test_an_upstream_stream_without_a_flight_changes_nothing(env: Env) -> None:
    upstream = env.stream(UPSTREAM)
    answer = await upstream.send(upstream_headers({"x-request-id": "unknown"}, attempt=2))
    assert sets(answer) == {}
    assert removes(answer) == []
    assert sets(await upstream.send(response_headers(500, request_id="unknown"))) == {}
    await upstream.close()


async def test_two_requests_sharing_an_id_get_no_failover_and_no_mixup(env: Env) -> None:
    """A client may send its own x-request-id: two live requests with the same one are told
    apart by nothing, so neither is found (each is recorded by its own router-level stream)."""
    first, _ = await routed(env, anthropic())
    second, _ = await routed(env, anthropic())
    upstream = env.stream(UPSTREAM)
    assert sets(await upstream.send(response_headers(401, request_id="rid-1"))) == {}
    await upstream.close()
    assert env.policies.pool.status_of("a").consecutive_faults == 0  # nobody's lease touched
    await first.send(response_headers(401, details="via_upstream"))
    await first.close()
    assert env.policies.pool.status_of("a").state is BreakerState.COOLED
    # The other still holds its id: a later stream finds nothing until it ends too.
    upstream = env.stream(UPSTREAM)
    assert sets(await upstream.send(response_headers(401, request_id="rid-1"))) == {}
    await upstream.close()
    await second.close()
    assert len(env.servicer.flights) == 0


# --- judge and tracing -----------------------------------------------------------------------


async def test_a_stalled_judge_fails_open(env: Env, otel_metrics: Any) -> None:
    env.mock.set_behaviour("*", Behaviour(headers_delay_secs=5))
    before = otel_metrics.value(tm.CLASSIFIER_FAIL_OPEN, route="auto", reason="deadline")
    stream, answer = await routed(env, anthropic("auto"))
    assert msgspec.json.decode(answer.request_body.response.body_mutation.body)["model"] == "big"
    final = sets(await stream.send(response_headers(200, details="via_upstream")))
    await stream.close()
    assert final["x-switchyard-route"] == b"fail_open:deadline"
    assert (
        otel_metrics.value(tm.CLASSIFIER_FAIL_OPEN, route="auto", reason="deadline") == before + 1
    )


async def test_the_judges_verdict_routes_the_request(env: Env) -> None:
    env.mock.set_behaviour("*", Behaviour(reply="simple"))
    stream, answer = await routed(env, anthropic("auto"))
    assert msgspec.json.decode(answer.request_body.response.body_mutation.body)["model"] == "small"
    await stream.close()


async def test_a_cancelled_stream_during_the_judge_counts_a_disconnect(
    env: Env, otel_metrics: Any
) -> None:
    env.mock.set_behaviour("*", Behaviour(headers_delay_secs=5))
    before = otel_metrics.value(tm.CLASSIFIER_FAIL_OPEN, route="auto", reason="disconnect")
    stream = env.stream()
    await stream.send(request_headers())
    task = asyncio.create_task(stream.send(request_body(anthropic("auto"))))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (
        otel_metrics.value(tm.CLASSIFIER_FAIL_OPEN, route="auto", reason="disconnect") == before + 1
    )


async def test_spans_join_envoys_trace(env: Env, otel_spans: InMemorySpanExporter) -> None:
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    parent = f"00-{trace_id}-00f067aa0ba902b7-01"
    stream = env.stream([("traceparent", parent)])
    await stream.send(request_headers())
    await stream.send(request_body(anthropic()))
    await stream.send(response_headers(200, details="via_upstream"))
    await stream.close()
    spans = {s.name: s for s in otel_spans.get_finished_spans()}
    request = spans[tm.SPAN_REQUEST]
    assert format(request.context.trace_id, "032x") == trace_id
    assert request.parent is not None
    assert format(request.parent.span_id, "016x") == "00f067aa0ba902b7"
    assert (request.attributes or {})[tm.RESPONSE_MODEL] == "m-var"
    attempt = spans[tm.SPAN_ATTEMPT]
    assert attempt.parent is not None
    assert attempt.parent.span_id == request.context.span_id


async def test_the_processor_records_request_metrics_at_the_response_headers(
    env: Env, otel_metrics: Any
) -> None:
    want = {
        tm.REQUEST_MODEL: "m-base",
        tm.RESPONSE_MODEL: "m-var",
        tm.VARIANT: "m-var",
        tm.ACCOUNT: "a",
    }
    ok = otel_metrics.value(tm.OPERATION_DURATION, **want)
    failed = otel_metrics.value(tm.OPERATION_DURATION, **want, **{tm.ERROR_TYPE: "500"})
    router, _ = await routed(env, anthropic())
    await router.send(response_headers(200))
    await router.close()
    assert otel_metrics.value(tm.OPERATION_DURATION, **want) == ok + 1
    router, _ = await routed(env, anthropic())
    await router.send(response_headers(500))
    await router.close()
    assert otel_metrics.value(tm.OPERATION_DURATION, **want, **{tm.ERROR_TYPE: "500"}) == (
        failed + 1
    )
