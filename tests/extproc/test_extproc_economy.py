"""What the servicer does not do per request, and that the answers do not change for it.

No span (nor trace-context parsing) without a tracer SDK; answers built once are shared but
never changed by a request; header options built once are bounded; the first user turn is not
hashed when a user id already decides the canary split.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from opentelemetry import propagate
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from extproc_helpers import Stream, removes, request_body, request_headers, response_headers, sets
from switchyard_mw import wire as wire_module
from switchyard_mw.accounts import build_accounts
from switchyard_mw.config import parse_config
from switchyard_mw.core.variant_buckets import Split
from switchyard_mw.extproc import ExtProcServicer, Policies
from switchyard_mw.extproc import _messages as msg
from switchyard_mw.extproc import router as router_module
from switchyard_mw.telemetry import names as tm

CONFIG = """
[llm_clients.a]
base_url = "https://prov.example"
api_key_env = "KEY_A"
auth = "x-api-key"
models = ["m-base", "m-var"]
priority = 0
failure_threshold = 1
envoy_cluster = "prov"

[llm_clients.b]
base_url = "https://prov.example"
api_key_env = "KEY_B"
models = ["m-base", "m-var"]
priority = 1
envoy_cluster = "prov"

[canaries."m-base"]
variants = { "m-var" = 50.0 }
"""
ENV = {"KEY_A": "secret-a", "KEY_B": "secret-b"}


@pytest.fixture
def servicer() -> ExtProcServicer:
    config = parse_config(CONFIG)
    return ExtProcServicer(Policies(config, build_accounts(config, ENV)))


def body(user: str | None = "u1", model: str = "m-base") -> bytes:
    fields: dict[str, Any] = {"model": model, "max_tokens": 100}
    fields["messages"] = [{"role": "user", "content": "hi"}]
    if user is not None:
        fields["metadata"] = {"user_id": user}
    return msgspec.json.encode(fields)


async def one_request(servicer: ExtProcServicer, payload: bytes, status: int = 200) -> list[Any]:
    stream = Stream(servicer, [("traceparent", "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01")])
    answers = [await stream.send(request_headers())]
    answers.append(await stream.send(request_body(payload)))
    answers.append(await stream.send(response_headers(status, details="via_upstream")))
    await stream.close()
    return answers


async def test_without_a_tracer_sdk_no_span_is_made_and_the_answers_are_the_same(
    servicer: ExtProcServicer, otel_spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    traced = await one_request(servicer, body())
    assert {s.name for s in otel_spans.get_finished_spans()} == {
        tm.SPAN_REQUEST,
        tm.SPAN_ATTEMPT,
        tm.SPAN_CLIENT.format(model="m-base"),
    }
    otel_spans.clear()

    def no_parsing(*_: Any) -> None:
        raise AssertionError("the trace context was parsed with no tracer SDK installed")

    monkeypatch.setattr(tm, "tracing", lambda: False)
    monkeypatch.setattr(propagate, "extract", no_parsing)
    untraced = await one_request(servicer, body())
    assert otel_spans.get_finished_spans() == ()
    assert [a.SerializeToString() for a in untraced] == [a.SerializeToString() for a in traced]


async def test_answers_built_once_are_not_changed_by_requests(servicer: ExtProcServicer) -> None:
    pristine = {
        "pass through": router_module._PASS_THROUGH.SerializeToString(),
        "read body": router_module._READ_BODY.SerializeToString(),
        "unchanged": msg.UNCHANGED_RESPONSE_HEADERS.SerializeToString(),
    }
    # Two accounts, two models, a refusal: each answer carries only its own request's headers.
    first = await one_request(servicer, body("u1"), status=401)
    second = await one_request(servicer, body("u1"))
    assert sets(first[1])["x-api-key"] == b"secret-a"
    assert sets(second[1])["authorization"] == b"Bearer secret-b"  # a cooled after the 401
    assert "x-api-key" not in sets(second[1])
    assert sets(second[2])["x-switchyard-account"] == b"b"
    assert removes(second[2]) == ["x-switchyard-retry", "x-switchyard-retry-after"]
    stream = Stream(servicer)
    get = await stream.send(request_headers("/healthz", {":method": "GET"}, end=True))
    await stream.close()
    assert removes(get) == ["x-switchyard-cluster", "x-switchyard-hedge"]
    assert {
        "pass through": router_module._PASS_THROUGH.SerializeToString(),
        "read body": router_module._READ_BODY.SerializeToString(),
        "unchanged": msg.UNCHANGED_RESPONSE_HEADERS.SerializeToString(),
    } == pristine


def test_header_options_built_once_are_bounded() -> None:
    options = msg.Options(limit=3)
    first = options.get("x-switchyard-model", b"m")
    assert options.get("x-switchyard-model", b"m") is first  # built once
    for ms in range(10):  # values that never repeat (a deadline cut to a budget)
        built = options.get("x-envoy-upstream-rq-timeout-ms", str(ms).encode())
        assert built.header.raw_value == str(ms).encode()
    assert len(options._built) <= 3


async def test_the_first_turn_is_hashed_only_without_a_user_id(
    servicer: ExtProcServicer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Counted where the hash is computed: the view keeps it, however often it is read
    # (the variant split and the account affinity both read it).
    hashed: list[bool] = []
    original = wire_module._turn_hash_of

    def counting(turn: Any) -> str:
        hashed.append(True)
        return original(turn)

    monkeypatch.setattr(wire_module, "_turn_hash_of", counting)
    with_user = await one_request(servicer, body("u1"))
    assert hashed == []
    without_user = await one_request(servicer, body(None))
    assert hashed == [True]
    split = Split.build("m-base", [("m-var", 50.0)], "")
    assert sets(with_user[2])["x-switchyard-model"] == split.pick("u1").encode()
    assert sets(without_user[2])["x-switchyard-model"] in (b"m-base", b"m-var")
