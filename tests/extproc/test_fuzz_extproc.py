"""Bad input, fuzzed through the ext_proc servicer: every body gets a clean answer for Envoy.

The same generated bodies and headers as `asgi/test_fuzz.py` (the ASGI stack), sent as Envoy would:
request headers, then the buffered body. Each answer must be a body-phase continue (the model
possibly rewritten, with a matching content-length) or an ImmediateResponse 400/413 in the
wire's error format; the servicer never raises and never hangs.
"""

from __future__ import annotations

import asyncio
import json

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc_helpers import Stream, common, request_body, request_headers
from fuzz_inputs import PATHS, header_values, mutated_bodies
from switchyard_mw.accounts import build_accounts
from switchyard_mw.config import parse_config
from switchyard_mw.extproc import ExtProcServicer, Policies
from switchyard_mw.testing import MockProvider

CONFIG = parse_config(
    """
[server]
max_body_bytes = 65536

[llm_clients.any]
base_url = "https://prov.example"
api_key_env = "KEY"
models = ["*"]
envoy_cluster = "prov"

[canaries.m]
variants = { m2 = 50 }

[routes.auto]
classifier = "llm"
judge = "any"
judge_model = "judge"
judge_deadline_ms = 200
choices = { pick = "m" }
fallback = "m2"
"""
)
MOCK = MockProvider()
SERVICER = ExtProcServicer(
    Policies(
        CONFIG,
        build_accounts(CONFIG, {"KEY": "k"}),
        judge_http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=MOCK)),
    )
)


async def exchange(path: str, body: bytes, extra: dict[str, str]) -> None:
    async with asyncio.timeout(5):
        stream = Stream(SERVICER)
        first = await stream.send(request_headers(path, extra))
        if first.WhichOneof("response") == "immediate_response":
            check_immediate(path, first)
            await stream.close()
            return
        answer = await stream.send(request_body(body))
        if answer.WhichOneof("response") == "immediate_response":
            check_immediate(path, answer)
        else:
            result = common(answer)
            mutation = result.body_mutation
            if mutation.HasField("body"):
                if _is_json(body):  # then the rewrite is the same JSON with another model
                    original, rewritten = json.loads(body), json.loads(mutation.body)
                    assert {**original, "model": rewritten["model"]} == rewritten
                lengths = [
                    o.header.raw_value
                    for o in result.header_mutation.set_headers
                    if o.header.key == "content-length"
                ]
                assert lengths == [str(len(mutation.body)).encode()]
        await stream.close()


def _is_json(body: bytes) -> bool:
    """Whether `body` is a JSON object Python's `json` can read back to compare. A body nested
    deeper than its recursion limit is not (its splice is checked in
    tests/wire/test_wire_splice.py, on a fresh stack): the comparison is skipped, rather than
    the fuzz run failing in this helper."""
    try:
        return isinstance(json.loads(body), dict)
    except (ValueError, RecursionError):
        return False


def check_immediate(path: str, answer: object) -> None:
    reply = answer.immediate_response  # type: ignore[attr-defined]
    assert reply.status.code in (400, 413), reply.status.code
    payload = json.loads(reply.body)
    if PATHS[path] == "anthropic":
        assert payload["type"] == "error"
        assert isinstance(payload["error"]["message"], str)
    else:
        assert payload["error"]["type"] == payload["error"]["code"]


FUZZ = settings(
    max_examples=1200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)


@FUZZ
@given(path=st.sampled_from(sorted(PATHS)), body=mutated_bodies())
def test_mutated_bodies_get_a_clean_answer_from_the_servicer(path: str, body: bytes) -> None:
    asyncio.run(exchange(path, body, {"content-length": str(len(body))}))


@settings(max_examples=600, deadline=None, database=None)
@given(
    path=st.sampled_from(sorted(PATHS)),
    name=st.sampled_from(
        ["x-switchyard-timeout-ms", "x-envoy-expected-rq-timeout-ms", "content-length"]
    ),
    value=header_values,
)
def test_bad_headers_get_a_clean_answer_from_the_servicer(
    path: str, name: str, value: bytes
) -> None:
    body = json.dumps({"model": "m", "max_tokens": 5, "messages": [], "input": "x"}).encode()
    text = value.decode("latin-1")
    asyncio.run(exchange(path, body, {name: text}))
