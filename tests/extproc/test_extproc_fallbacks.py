"""Fallback chains in the processor, driven message by message as Envoy drives it: a 400's
body asked for by the upstream-level filter, the retry header from the body phase, and a
filter that never sends the body (no `allow_mode_override`)."""

from __future__ import annotations

import msgspec

from extproc_helpers import (
    Stream,
    request_body,
    request_headers,
    response_body,
    response_headers,
    sets,
    upstream_headers,
)
from switchyard_mw.accounts import build_accounts
from switchyard_mw.config import parse_config
from switchyard_mw.extproc import ExtProcServicer, Policies

CONFIG = """
[llm_clients.a]
base_url = "https://api.openai.com"
api_key_env = "KEY_A"
models = ["m"]
envoy_cluster = "prov"

[llm_clients.b]
base_url = "https://api.openai.com"
api_key_env = "KEY_A"
models = ["m"]
priority = 1
envoy_cluster = "prov"

[llm_clients.c]
base_url = "https://api.openai.com"
api_key_env = "KEY_C"
models = ["m-big"]
envoy_cluster = "prov"

[fallbacks]
m = { models = ["m-big"], on = ["context_length"] }
"""
BODY = msgspec.json.encode({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
TOO_LONG = msgspec.json.encode(
    {
        "error": {
            "message": "too long",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    }
)
RID = "rid-fallbacks"
UPSTREAM = [("x-switchyard-filter", "upstream")]


async def routed() -> tuple[ExtProcServicer, Stream, Policies]:
    config = parse_config(CONFIG)
    policies = Policies(config, build_accounts(config, {"KEY_A": "ka", "KEY_C": "kc"}))
    servicer = ExtProcServicer(policies)
    router = Stream(servicer)
    await router.send(request_headers(path="/v1/chat/completions", extra={"x-request-id": RID}))
    answer = await router.send(request_body(BODY))
    assert sets(answer)["authorization"] == b"Bearer ka"
    return servicer, router, policies


async def test_a_context_length_refusal_is_read_and_retried_on_the_chain_s_model() -> None:
    servicer, router, _ = await routed()
    upstream = Stream(servicer, UPSTREAM)
    asked = await upstream.send(response_headers(400, request_id=RID))
    assert asked.HasField("mode_override")  # the body, buffered: Envoy holds the headers
    retry = await upstream.send(response_body(TOO_LONG, end=True))
    assert sets(retry) == {"x-switchyard-retry": b"1"}
    await upstream.close()
    upstream = Stream(servicer, UPSTREAM)
    swapped = await upstream.send(upstream_headers({"x-request-id": RID}, attempt=2))
    assert sets(swapped)["authorization"] == b"Bearer kc"  # m-big's account, not b
    replaced = await upstream.send(request_body(BODY))
    body = replaced.request_body.response.body_mutation.body
    assert msgspec.json.decode(body)["model"] == "m-big"
    await upstream.close()
    final = await router.send(response_headers(200, details="via_upstream"))
    assert sets(final)["x-switchyard-route"] == b"fallback:context_length"
    assert sets(final)["x-switchyard-model"] == b"m-big"
    await router.close()


async def test_another_400_goes_on_unchanged() -> None:
    servicer, router, _ = await routed()
    upstream = Stream(servicer, UPSTREAM)
    await upstream.send(response_headers(400, request_id=RID))
    kept = await upstream.send(response_body(b'{"error": {"code": "invalid_value"}}', end=True))
    assert sets(kept) == {}
    await upstream.close()
    final = await router.send(response_headers(400, details="via_upstream"))
    assert sets(final)["x-switchyard-model"] == b"m"
    await router.close()


async def test_a_400_whose_body_never_comes_is_the_answer() -> None:
    servicer, router, policies = await routed()
    upstream = Stream(servicer, UPSTREAM)
    await upstream.send(response_headers(400, request_id=RID))
    await upstream.close()  # no body phase: the filter could not switch modes
    final = await router.send(response_headers(400, details="via_upstream"))
    assert sets(final)["x-switchyard-model"] == b"m"
    assert "x-switchyard-route" not in sets(final)
    await router.close()
    assert all(policies.pool.status_of(n).consecutive_faults == 0 for n in ("a", "b", "c"))
