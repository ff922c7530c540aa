"""The same requests through both fronts make the same decisions.

Each scenario says how every account's upstream answers. The ASGI front runs the whole stack
in process around a small forwarding app that calls the mock provider with the chosen
account's key. The ext_proc front is driven phase by phase as Envoy would drive it: the
router-level stream picks the account, the test plays the upstream's answer for that
account's key (to the upstream-level stream on a fault or a 429, as envoy.yaml's matcher
does), follows a retry the processor asks for, and ends with the final response headers.

What must match: the status, the error type and text of the answers switchyard makes itself,
the `x-switchyard-*`, `retry-after` and `x-should-retry` headers, every attempt span's name,
attributes and status, and each attempt's CLIENT span (`chat {model}`): its name, `error.type`
and status.
An attempt span's `error.type` is left out: it names an exception's class, and only the ASGI
front sees exceptions (Envoy reports a failed connection as a reply).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
import pytest
import yaml
from machine_moves import machine_moves  # noqa: F401 (autouse: each move is a row)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from extproc_helpers import (
    Stream,
    common,
    immediate,
    request_body,
    request_headers,
    response_body,
    response_headers,
    sets,
    upstream_headers,
)
from servers import ROOT
from switchyard_mw import switchyard_stack
from switchyard_mw.accounts import build_accounts
from switchyard_mw.asgi._types import Receive, Scope, Send
from switchyard_mw.config import Config, parse_config
from switchyard_mw.context import current_context
from switchyard_mw.core.pool import AccountPool, Cause, Outcome, classify_status
from switchyard_mw.extproc import ExtProcServicer, Policies
from switchyard_mw.testing import Behaviour, MockProvider
from switchyard_mw.testing._wire_replies import billing_body
from two_fronts import (
    Decisions,
    attempt_spans,
    client_spans,
    decoded,
    error_of,
    kept_headers,
    post_through,
)

TWO = """
[llm_clients.a]
base_url = "https://api.anthropic.com"
api_key_env = "KEY_A"
auth = "x-api-key"
models = ["m"]
priority = 0
failure_threshold = 1
cooldown_secs = 30
envoy_cluster = "prov"
timeout_secs = {timeout}

[llm_clients.b]
base_url = "https://api.anthropic.com"
api_key_env = "KEY_B"
auth = "x-api-key"
models = ["m"]
priority = 1
failure_threshold = 1
cooldown_secs = 30
envoy_cluster = "prov"
timeout_secs = {timeout}
"""
ONE = TWO.split("[llm_clients.b]")[0]
RENAMED = TWO.replace('models = ["m"]\npriority = 1', 'models = {{ m = "m-at-b" }}\npriority = 1')
"""Account b knows model m by its own name: a failover to it must send that name."""
DUAL = TWO.replace('models = ["m"]\npriority = 0', 'models = ["m", "m-b"]\npriority = 0')
"""Account a serves two models, m and m-b: a model fault of m-b is (a, m-b)'s alone."""
CANARY = (
    ONE
    + TWO.split("[llm_clients.b]")[1]
    .replace('models = ["m"]', 'models = ["m-var"]')
    .replace("priority = 1", "priority = 0")
    .join(["[llm_clients.v]", ""])
    + """
[canaries.m]
variants = {{ "m-var" = 100.0 }}
"""
)
"""a serves m; v serves the canary variant m-var that takes every conversation of m."""
FALLBACK = (
    ONE
    + TWO.split("[llm_clients.b]")[1]
    .replace('models = ["m"]', 'models = ["m-small"]')
    .replace("KEY_B", "KEY_C")
    .join(["[llm_clients.c]", ""])
    + """
[fallbacks]
m = ["m-small"]
"""
)
"""a serves m; c, on the same cluster, serves m-small, m's fallback."""
CONTEXT = (
    TWO
    + FALLBACK.split("[llm_clients.c]")[1]
    .split("[fallbacks]")[0]
    .replace('"m-small"', '"m-big"')
    .join(["[llm_clients.c]", ""])
    + """
[fallbacks]
m = {{ models = ["m-big"], on = ["context_length"] }}
"""
)
"""a and b serve m; c serves m-big, where a prompt too long for m goes."""
ACROSS = """
[server.envoy_failover]
"prov-then-other" = ["prov", "other"]
"other-then-prov" = ["other", "prov"]
"""
"""Two provider clusters and Envoy's aggregates over them: a retry moves to the other."""


def _elsewhere(config: str, account: str) -> str:
    """`config` with `account` on the other provider's cluster, and the aggregates."""
    head, tail = config.split(f"[llm_clients.{account}]")
    moved = tail.replace('envoy_cluster = "prov"', 'envoy_cluster = "other"', 1)
    return f"{head}[llm_clients.{account}]{moved}{ACROSS}"


PROVIDERS = _elsewhere(TWO, "b")
"""a on the provider cluster prov, b on the provider cluster other."""
ONE_PROVIDER_S_MODEL = _elsewhere(
    TWO
    + TWO.split("[llm_clients.b]")[1]
    .replace('models = ["m"]', 'models = ["n"]')
    .replace("KEY_B", "KEY_C")
    .join(["[llm_clients.c]", ""]),
    "c",
)
"""a and b on prov serve m, c on the other provider serves only n: m's request stays on prov,
whose other key takes its retry."""
PROVIDERS_RENAMED = _elsewhere(RENAMED, "b")
"""As PROVIDERS, b knowing model m by its own name."""
TOO_LONG = Behaviour(refuse="context_length")
TOO_LONG_BODY = msgspec.json.encode(
    {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "prompt is too long: 9 > 8"},
    }
)
FALLBACK_ACROSS = _elsewhere(FALLBACK, "c")
"""a on prov serves m; c on the other provider's cluster serves m-small, m's fallback."""
BILLING = Behaviour(refuse="billing")
"""Anthropic's 400 "Your credit balance is too low": a refusal of the account's billing."""
ENV = {"KEY_A": "ka", "KEY_B": "kb", "KEY_C": "kc"}
ACCOUNT_OF_KEY = {"ka": "a", "kb": "b", "kc": "c"}
IN_PLACE = ONE.replace(
    "failure_threshold = 1\n", "failure_threshold = 2\nretry_wait_max_secs = 5\n"
)
"""a alone, retried in place after a 429 of up to 5 s or a 5xx (one fault does not cool it)."""
BODY = msgspec.json.encode(
    {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
)
UNREACHABLE = "unreachable"
ENVOY_YAML = ROOT / "examples" / "envoy" / "envoy.yaml"
"""An account whose upstream refuses the connection."""
SLOW = Behaviour(headers_delay_secs=30.0)
"""An upstream that answers long after the attempt's deadline."""
Upstream = Behaviour | str


@dataclass(frozen=True)
class Scenario:
    config: str
    upstream: Mapping[str, Upstream]
    """How each account (by key) answers."""
    own_answer: bool = False
    """Switchyard answers itself (an error of its own), not the upstream."""
    before: str = ""
    """What happened to the accounts earlier: "cooled" (after an outage), "refused" (their
    credentials) or "throttled", all of them; or one such word per account, comma-separated."""
    timeout: float = 60.0
    content_type: str = "application/json"


SCENARIOS = {
    "served": Scenario(TWO, {"ka": Behaviour()}),
    "failover after a 500": Scenario(TWO, {"ka": Behaviour(status=500), "kb": Behaviour()}),
    "failover after a 429": Scenario(TWO, {"ka": Behaviour(status=429), "kb": Behaviour()}),
    "failover to an account with its own model name": Scenario(
        RENAMED, {"ka": Behaviour(status=500), "kb": Behaviour()}
    ),
    "failover after a 401": Scenario(TWO, {"ka": Behaviour(status=401), "kb": Behaviour()}),
    "a lone account's 500 is passed on": Scenario(ONE, {"ka": Behaviour(status=500)}),
    "every account answers 500": Scenario(
        TWO, {"ka": Behaviour(status=500), "kb": Behaviour(status=500)}
    ),
    "a client error is no fault": Scenario(TWO, {"ka": Behaviour(status=400)}),
    "every account cooling": Scenario(TWO, {}, own_answer=True, before="cooled"),
    "every account throttled": Scenario(TWO, {}, own_answer=True, before="throttled"),
    "every key refused": Scenario(TWO, {}, own_answer=True, before="refused"),
    "a key refused, an account down": Scenario(TWO, {}, own_answer=True, before="refused,cooled"),
    "deadline": Scenario(ONE, {"ka": SLOW}, own_answer=True, timeout=0.3),
    "a whole answer late past its deadline fails over": Scenario(
        TWO, {"ka": SLOW, "kb": Behaviour()}, timeout=0.3
    ),
    "unreachable": Scenario(ONE, {"ka": UNREACHABLE}, own_answer=True),
    "the canary's base takes over from a cooling variant": Scenario(
        CANARY, {"ka": Behaviour(), "kb": Behaviour()}, before="variant cooled"
    ),
    "not JSON": Scenario(TWO, {"ka": Behaviour()}, content_type="text/plain"),
    "m's account fails: the fallback model on the same cluster serves": Scenario(
        FALLBACK, {"ka": Behaviour(status=500), "kc": Behaviour()}
    ),
    "m's account cooling: the fallback model from the first attempt": Scenario(
        FALLBACK, {"kc": Behaviour()}, before="cooled"
    ),
    "a context-length refusal: the larger model, not m's other account": Scenario(
        CONTEXT, {"ka": TOO_LONG, "kb": TOO_LONG, "kc": Behaviour()}
    ),
    "a context-length refusal without a chain: the 400 once": Scenario(
        TWO, {"ka": TOO_LONG, "kb": Behaviour()}
    ),
    "another model of the account failing leaves this one served": Scenario(
        DUAL, {"ka": Behaviour()}, before="other model cooled"
    ),
    "this model failing while another model of the account serves": Scenario(
        DUAL, {"ka": Behaviour(status=503), "kb": Behaviour()}, before="other model served"
    ),
    "a key refused on another model moves this one too": Scenario(
        DUAL, {"kb": Behaviour()}, before="other model refused"
    ),
    "a billing refusal (a 400): the next account, never the client's 400": Scenario(
        TWO, {"ka": BILLING, "kb": Behaviour()}
    ),
    "a lone account's billing refusal: the credential 503 at once": Scenario(
        ONE, {"ka": BILLING}, own_answer=True
    ),
    "every key refused in the request: the credential 503 at once, not the last 403": Scenario(
        TWO, {"ka": Behaviour(status=401), "kb": Behaviour(status=403)}, own_answer=True
    ),
    "a lone account's 429 retried in place": Scenario(
        IN_PLACE, {"ka": Behaviour(status=429, times=1)}
    ),
    "a lone account's 500 once retried in place": Scenario(
        IN_PLACE, {"ka": Behaviour(status=500, times=1)}
    ),
    "a lone account's second 429 is passed on": Scenario(IN_PLACE, {"ka": Behaviour(status=429)}),
    "an outage of one provider: the other provider's cluster serves": Scenario(
        PROVIDERS, {"ka": Behaviour(status=503), "kb": Behaviour()}
    ),
    "a 429 of one provider: the other provider's cluster serves": Scenario(
        PROVIDERS, {"ka": Behaviour(status=429), "kb": Behaviour()}
    ),
    "every provider answers 500": Scenario(
        PROVIDERS, {"ka": Behaviour(status=500), "kb": Behaviour(status=500)}
    ),
    "the first provider throttled: the other provider from the first attempt": Scenario(
        PROVIDERS, {"kb": Behaviour()}, before="throttled,-"
    ),
    "the other provider knows the model by its own name": Scenario(
        PROVIDERS_RENAMED, {"ka": Behaviour(status=500), "kb": Behaviour()}
    ),
    "a model one provider serves: its other key takes the retry, not the aggregate": Scenario(
        ONE_PROVIDER_S_MODEL, {"ka": Behaviour(status=500), "kb": Behaviour()}
    ),
    "m's provider fails: the fallback model on another provider's cluster serves": Scenario(
        FALLBACK_ACROSS, {"ka": Behaviour(status=500), "kc": Behaviour()}
    ),
    "a lone account's 500 that cooled it is passed on at once": Scenario(
        ONE.replace("failure_threshold = 1\n", "failure_threshold = 1\nretry_wait_max_secs = 5\n"),
        {"ka": Behaviour(status=500, times=1)},
    ),
}


def _before(pool: AccountPool, scenario: Scenario) -> None:
    accounts = pool.accounts_for("m")
    events = scenario.before.split(",")
    if len(events) == 1:
        events *= len(accounts)
    for account, event in zip(accounts, events, strict=True):
        if event in ("cooled", "refused"):
            lease = pool.acquire("m", allowed={account})
            assert lease is not None
            pool.record(lease, Outcome.FAULT, _CAUSES[event])
        elif event == "throttled":
            pool.hold(account, "m", 30.0, wall_now=time.time())
    if scenario.before == "variant cooled":
        lease = pool.acquire("m-var")
        assert lease is not None
        pool.record(lease, Outcome.FAULT)
    if scenario.before.startswith("other model "):
        # Account a's other model, m-b: cooled after an outage, refused, or serving.
        lease = pool.acquire("m-b")
        assert lease is not None
        event = scenario.before.removeprefix("other model ")
        if event == "served":
            pool.record(lease, Outcome.SUCCESS)
        else:
            pool.record(lease, Outcome.FAULT, _CAUSES[event])


_CAUSES = {"cooled": Cause.OUTAGE, "refused": Cause.CREDENTIALS}


def _config(scenario: Scenario) -> Config:
    return parse_config(scenario.config.format(timeout=scenario.timeout))


# --- the ASGI front ---------------------------------------------------------------------------


class _Upstreams(httpx.AsyncBaseTransport):
    """The mock provider in process; a refused connection for an unreachable account."""

    def __init__(self, mock: MockProvider, upstream: Mapping[str, Upstream]) -> None:
        self._mock = httpx.ASGITransport(app=mock)
        self._upstream = upstream

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self._upstream.get(request.headers.get("x-api-key", "")) == UNREACHABLE:
            raise httpx.ConnectError("connection refused", request=request)
        return await self._mock.handle_async_request(request)


def _forwarding_app(http: httpx.AsyncClient) -> Any:
    """Sends the request to the account switchyard chose, and its answer back."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        ctx = current_context()
        client = None if ctx is None else ctx.account
        if client is None:  # nothing decided: the app answers on its own
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})
            return
        reply = await http.post(
            scope["path"],
            content=body,
            headers=[("content-type", "application/json"), *client.auth_headers()],
        )
        headers = [(k.encode(), v.encode()) for k, v in reply.headers.items()]
        await send({"type": "http.response.start", "status": reply.status_code, "headers": headers})
        await send({"type": "http.response.body", "body": reply.content})

    return app


async def through_asgi(scenario: Scenario, spans: InMemorySpanExporter) -> Decisions:
    mock = MockProvider()
    for key, behaviour in scenario.upstream.items():
        if isinstance(behaviour, Behaviour):
            mock.set_behaviour(key, behaviour)
    upstream = httpx.AsyncClient(
        transport=_Upstreams(mock, scenario.upstream), base_url="http://upstream.test"
    )
    stack = switchyard_stack(_forwarding_app(upstream), config=_config(scenario), environ=ENV)
    _before(stack.pool, scenario)
    spans.clear()
    reply = await post_through(stack, upstream, BODY, scenario.content_type)
    decisions = Decisions(
        status=reply.status_code,
        headers=kept_headers(reply.headers),
        attempts=attempt_spans(spans),
        calls=client_spans(spans),
        sent=[(r.key, r.model or "") for r in mock.requests],
    )
    if scenario.own_answer:
        decisions.error = error_of(reply.json())
    return decisions


# --- the ext_proc front, driven as Envoy drives it -----------------------------------------

UPSTREAM_FILTER = [("x-switchyard-filter", "upstream")]
RID = "rid-two-fronts"
_RESET = "upstream_reset_before_response_started{connection_failure}"


def _key_of(answer_sets: Mapping[str, bytes]) -> str:
    return answer_sets["x-api-key"].decode()


def _model_of(answer: Any, replayed: bytes) -> str:
    """The `model` of the body Envoy sends on: the answer's replacement, else `replayed`."""
    body = common(answer).body_mutation.body if answer is not None else b""
    return str(msgspec.json.decode(body or replayed)["model"])


def _envoy_order(config: Config, routed: str) -> tuple[str, ...]:
    """The clusters Envoy sends a request routed to `routed` to, attempt after attempt: an
    aggregate's in order (envoy.yaml's retry priority, previous_priorities), else itself."""
    return tuple(config.server.envoy_failover.get(routed, [routed]))


async def _play_attempts(
    servicer: ExtProcServicer,
    scenario: Scenario,
    key: str,
    sent: list[tuple[str, str]],
    order: tuple[str, ...] = (),
) -> tuple[Upstream, str]:
    """Each attempt's upstream answer, following the retries the processor asks for; the
    last attempt's answer and key. `sent` has the router's body model for attempt 1; each
    retry's (Envoy replays that body, which the retry filter may replace) is added. `order`:
    the clusters of Envoy's attempts in turn, when more than one (the retry's endpoint
    names its cluster)."""
    attempt = 1
    upstream = Stream(servicer, UPSTREAM_FILTER)  # attempt 1: only its response is filtered
    routed_body = BODY.replace(b'"m"', f'"{sent[0][1]}"'.encode())
    answered: dict[str, int] = {}
    while True:
        answer = scenario.upstream[key]
        answered[key] = answered.get(key, 0) + 1
        if isinstance(answer, Behaviour) and 0 < answer.times < answered[key]:
            answer = Behaviour()  # the mock's `times`: healthy once they are spent
        if answer == SLOW:
            # Envoy's per-try timeout (the attempt's deadline) ends the try with no answer;
            # the route timeout (two deadlines) ends the request at the second.
            await upstream.close()
            await asyncio.sleep(scenario.timeout)
            if attempt == 2:
                return answer, key
            attempt += 1
            key = await _retried(servicer, attempt, key, routed_body, sent, order)
            upstream = Stream(servicer, UPSTREAM_FILTER)
            continue
        # envoy.yaml's matcher: the upstream filter sees 400, 401/402/403, 429 and 5xx only
        status = _status(answer)
        if status != 400 and classify_status(status) is Outcome.SUCCESS:
            await upstream.close()
            return answer, key
        extra = {"retry-after": "1"} if status == 429 else {}
        reply = await upstream.send(response_headers(status, extra, request_id=RID))
        if reply.HasField("mode_override"):  # a 400 to read: its body, in one piece
            body = _body_of(answer)
            reply = await upstream.send(response_body(body, end=True))
        await upstream.close()
        if sets(reply).get("x-switchyard-retry") != b"1":
            return answer, key
        attempt += 1
        key = await _retried(servicer, attempt, key, routed_body, sent, order)
        upstream = Stream(servicer, UPSTREAM_FILTER)


class _Replied(Exception):
    """The retry filter answered Envoy's retry itself (an immediate response, which Envoy
    sends to the client)."""

    def __init__(self, reply: Any) -> None:
        self.reply = reply


async def _retried(
    servicer: ExtProcServicer,
    attempt: int,
    key: str,
    routed_body: bytes,
    sent: list[tuple[str, str]],
    order: tuple[str, ...],
) -> str:
    """Envoy's retry `attempt` through the retry filter: the key it goes with (`key` again
    when the processor swaps none in), and what it sends added to `sent`."""
    retry_filter = Stream(servicer, UPSTREAM_FILTER)
    cluster = order[(attempt - 1) % len(order)] if len(order) > 1 else None
    retry = await retry_filter.send(
        upstream_headers({"x-request-id": RID}, attempt=attempt, cluster=cluster)
    )
    if retry.WhichOneof("response") == "immediate_response":
        await retry_filter.close()
        raise _Replied(retry)
    key = sets(retry).get("x-api-key", key.encode()).decode()
    replaced = await retry_filter.send(request_body(routed_body))
    await retry_filter.close()
    sent.append((key, _model_of(replaced, routed_body)))
    return key


def _status(answer: Upstream) -> int:
    """The status an upstream answers with (0: none, it is unreachable)."""
    if not isinstance(answer, Behaviour):
        return 0
    if answer.refuse == "billing":
        return billing_body("/v1/messages")[0]
    return 400 if answer.refuse == "context_length" else answer.status


def _body_of(answer: Upstream) -> bytes:
    """The error body of an answer the processor asks to read (the mock's, for a refusal)."""
    if answer is TOO_LONG:
        return TOO_LONG_BODY
    if isinstance(answer, Behaviour) and answer.refuse == "billing":
        return billing_body("/v1/messages")[1]
    return b'{"type":"error"}'


async def through_extproc(scenario: Scenario, spans: InMemorySpanExporter) -> Decisions:
    config = _config(scenario)
    policies = Policies(config, build_accounts(config, ENV))
    _before(policies.pool, scenario)
    servicer = ExtProcServicer(policies)
    spans.clear()
    router = Stream(servicer)
    extra = {"x-request-id": RID, "content-type": scenario.content_type}
    await router.send(request_headers(extra=extra))
    if scenario.content_type != "application/json":
        final = await router.send(response_headers(200))
        await router.close()
        return Decisions(200, headers=kept_headers(decoded(sets(final))))
    routed = await router.send(request_body(BODY))
    if routed.WhichOneof("response") == "immediate_response":
        await router.close()
        return _immediate(routed, spans)
    sent = [(_key_of(sets(routed)), _model_of(routed, BODY))]
    order = _envoy_order(config, sets(routed)["x-switchyard-cluster"].decode())
    try:
        answer, _ = await _play_attempts(servicer, scenario, sent[0][0], sent, order)
    except _Replied as replied:
        # Envoy sends the retry filter's answer on as the response, through the router-level
        # stream: its response headers (the reply's details) get the processor's headers.
        status, headers, body = immediate(replied.reply)
        details = replied.reply.immediate_response.details
        final = await router.send(response_headers(status, details=details))
        await router.close()
        return Decisions(
            status,
            error=error_of(body),
            headers=kept_headers({**decoded(headers), **decoded(sets(final))}),
            attempts=attempt_spans(spans),
            calls=client_spans(spans),
            sent=sent,
        )
    # What reached a provider: an unreachable one got nothing.
    sent = [(key, model) for key, model in sent if scenario.upstream.get(key) != UNREACHABLE]
    if answer == UNREACHABLE:
        final = await router.send(response_headers(503, details=_RESET))
    elif answer == SLOW:
        final = await router.send(response_headers(504, details="upstream_response_timeout"))
    else:
        assert isinstance(answer, Behaviour)
        final = await router.send(response_headers(_status(answer), details="via_upstream"))
    await router.close()
    if final.WhichOneof("response") == "immediate_response":
        decisions = _immediate(final, spans)
        decisions.sent = sent
        return decisions
    if answer == UNREACHABLE:  # the processor lets Envoy's own reply pass: envoy.yaml shapes it
        status, body = envoy_local_reply("/v1/messages")
        return Decisions(
            status,
            error=error_of(body),
            headers=kept_headers(decoded(sets(final))),
            attempts=attempt_spans(spans),
            calls=client_spans(spans),
            sent=sent,
        )
    # The client gets the upstream's headers with the processor's set over them.
    upstream = (
        {"retry-after": "1"} if isinstance(answer, Behaviour) and answer.status == 429 else {}
    )
    return Decisions(
        _status(answer),
        headers=kept_headers({**upstream, **decoded(sets(final))}),
        attempts=attempt_spans(spans),
        calls=client_spans(spans),
        sent=sent,
    )


def envoy_local_reply(path: str) -> tuple[int, dict[str, Any]]:
    """Envoy's own reply when no provider answered a request to `path`, as the shipped
    examples/envoy/envoy.yaml's local_reply_config makes it: its status and JSON body."""
    config = yaml.safe_load(ENVOY_YAML.read_text())
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    for mapper in manager["typed_config"]["local_reply_config"]["mappers"]:
        if path.startswith(tuple(_prefixes(mapper["filter"]))):
            return mapper["status_code"], mapper["body_format_override"]["json_format"]
    raise AssertionError(f"envoy.yaml shapes no local reply for {path}")


def _prefixes(access_filter: dict[str, Any]) -> Iterator[str]:
    for kind, value in access_filter.items():
        if kind == "header_filter":
            yield value["header"]["string_match"]["prefix"]
        elif kind in ("and_filter", "or_filter"):
            for inner in value["filters"]:
                yield from _prefixes(inner)


def _immediate(answer: Any, spans: InMemorySpanExporter) -> Decisions:
    status, headers, body = immediate(answer)
    return Decisions(
        status,
        error=error_of(body),
        headers=kept_headers(decoded(headers)),
        attempts=attempt_spans(spans),
        calls=client_spans(spans),
    )


@pytest.mark.parametrize("scenario", SCENARIOS.values(), ids=SCENARIOS.keys())
async def test_both_fronts_decide_alike(
    scenario: Scenario, otel_spans: InMemorySpanExporter
) -> None:
    asgi = await through_asgi(scenario, otel_spans)
    extproc = await through_extproc(scenario, otel_spans)
    assert asgi == extproc
    if scenario.config is RENAMED:  # each account got the model in its own name
        assert asgi.sent == [("ka", "m"), ("kb", "m-at-b")]
    if scenario.config is FALLBACK:  # the fallback's account got its model, and it is said
        assert asgi.sent[-1] == ("kc", "m-small")
        assert asgi.headers["x-switchyard-model"] == "m-small"
        assert asgi.headers["x-switchyard-route"] == "fallback:unavailable"
    if scenario.config is ONE_PROVIDER_S_MODEL:
        assert asgi.sent == [("ka", "m"), ("kb", "m")]
    if scenario.config in (PROVIDERS, PROVIDERS_RENAMED, FALLBACK_ACROSS):
        # The other provider's account served, in the same request (its model, its name).
        served = {PROVIDERS: ("kb", "m"), PROVIDERS_RENAMED: ("kb", "m-at-b")}
        if asgi.status == 200:
            assert asgi.sent[-1] == served.get(scenario.config, ("kc", "m-small"))
    if scenario.config is CONTEXT:
        assert asgi.sent == [("ka", "m"), ("kc", "m-big")]
        assert asgi.headers["x-switchyard-route"] == "fallback:context_length"
    if scenario.upstream.get("ka") is TOO_LONG and scenario.config is TWO:
        assert (asgi.status, asgi.sent) == (400, [("ka", "m")])
    if scenario.config is DUAL:  # m-b's outage stays m-b's; a refused key is all of a's
        served = {"other model cooled": "a", "other model served": "b"}.get(scenario.before, "b")
        assert asgi.headers["x-switchyard-account"] == served
        assert [key for key, _ in asgi.sent] == (
            ["ka", "kb"] if scenario.before == "other model served" else [f"k{served}"]
        )
    if scenario.content_type == "application/json":
        assert asgi.attempts or scenario.before, "the scenario made no attempt"
        assert len(asgi.calls) == len(asgi.attempts), "each attempt has its CLIENT span"


async def test_a_streams_first_bound_is_the_sooner_of_its_headers_and_first_token() -> None:
    """Both fronts bound a stream's start by the sooner of `timeout_secs` and
    `first_token_secs` (a stream without headers has no content either): the deadline they
    report and, under Envoy, the per-try timeout that enforces it. After the headers, both
    hold a stream until its first content event (under Envoy, the first-token filter:
    tests/extproc/test_envoy_first_token_live.py)."""
    text = ONE.format(timeout=60.0) + "first_token_secs = 0.5\n"
    config = parse_config(text)
    body = msgspec.json.encode({**msgspec.json.decode(BODY), "stream": True})
    mock = MockProvider()
    upstream = httpx.AsyncClient(transport=_Upstreams(mock, {}), base_url="http://upstream.test")
    stack = switchyard_stack(_forwarding_app(upstream), config=config, environ=ENV)
    reply = await post_through(stack, upstream, body)
    assert reply.status_code == 200
    asgi = reply.headers["x-switchyard-deadline-ms"]

    policies = Policies(config, build_accounts(config, ENV))
    router = Stream(ExtProcServicer(policies))
    await router.send(request_headers(extra={"x-request-id": RID}))
    routed = sets(await router.send(request_body(body)))
    final = sets(await router.send(response_headers(200, details="via_upstream")))
    await router.close()
    assert asgi == final["x-switchyard-deadline-ms"].decode() == "500"
    assert routed["x-envoy-upstream-rq-per-try-timeout-ms"] == b"500"
