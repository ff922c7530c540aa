"""Bedrock accounts through both fronts make the same decisions (the comparison of
test_two_fronts.py, for cloud accounts).

Both fronts send every attempt to the mock provider's Bedrock face in process, which re-signs
each request with botocore and refuses any mismatch, and records the access key id and the
model id of the path: so "what the upstream got" is the key that signed it and the model id it
went under, on either front.

- The ASGI front runs the whole stack around the gateway's own forwarding app
  (`gateway.Forwarder`), which re-envelopes and signs a Bedrock attempt and maps Bedrock's
  errors (the small forwarding app of test_two_fronts.py knows no cloud).
- The ext_proc front is driven as Envoy drives the example's upstream chain, attempt by
  attempt: the router-level stream routes the request; a retry's request headers and body go
  through the retry filter (which gives the retry its account, and its cluster through an
  aggregate); on a cloud cluster the cloud filter's stream re-envelopes and signs the body
  (`extproc.cloud`); the request then goes to the mock as Envoy would send it, with the
  headers and body those answers made; the mock's answer goes back through the cloud filter
  (a Bedrock error read whole and mapped), then to the refusal filter when its status is one
  envoy.yaml's matcher passes; a retry mark starts the next attempt, else the router-level
  stream gets the last answer's headers.

Compared as in test_two_fronts.py, and one thing more: the error a Bedrock refusal reaches the
client as (its type and text, mapped by the same code on either front).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
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
from switchyard_mw import switchyard_stack
from switchyard_mw.accounts import build_accounts
from switchyard_mw.config import parse_config
from switchyard_mw.core.pool import AccountPool, Cause, Outcome
from switchyard_mw.extproc import ExtProcServicer, Policies
from switchyard_mw.testing import Behaviour, MockProvider
from two_fronts import (
    Answer,
    Decisions,
    Outgoing,
    attempt_spans,
    client_spans,
    decoded,
    error_of,
    kept_headers,
    send_upstream,
)

pytest.importorskip("botocore")
pytest.importorskip("aiohttp")
from switchyard_mw.gateway import Forwarder
from switchyard_mw.testing._bedrock_face import (
    MOCK_AWS_ACCESS_KEY_ID,
    MOCK_AWS_SECRET_ACCESS_KEY,
)

OPUS_US = "us.anthropic.claude-opus-5-v1:0"
OPUS_EU = "eu.anthropic.claude-opus-5-v1:0"
"""`claude-opus-5` under each Bedrock account's own cross-region profile."""
FIRST_KEY = MOCK_AWS_ACCESS_KEY_ID
SECOND_KEY = "AKIAMOCKBEDROCK00002"
SECOND_SECRET = "second/mock/secret"
API_KEY = "ka"
ENV = {"KEY_A": API_KEY}
RID = "rid-two-fronts-clouds"

BEDROCK = f"""
[llm_clients.aws]
kind = "bedrock"
base_url = "https://bedrock.test"
bedrock = {{ region = "us-east-1" }}
models = {{ "claude-opus-5" = "{OPUS_US}" }}
failure_threshold = 1
cooldown_secs = 30
envoy_cluster = "bedrock"

[llm_clients.aws-second]
kind = "bedrock"
base_url = "https://bedrock.test"
bedrock = {{ region = "us-west-2", profile = "second" }}
models = {{ "claude-opus-5" = "{OPUS_EU}" }}
priority = 1
failure_threshold = 1
cooldown_secs = 30
envoy_cluster = "bedrock"
"""
"""Two Bedrock accounts on one cloud cluster, each under its own model id (and key)."""
ONE_BEDROCK = BEDROCK.split("[llm_clients.aws-second]")[0]
THEN_API = (
    ONE_BEDROCK
    + """
[llm_clients.api]
base_url = "https://api.anthropic.com"
api_key_env = "KEY_A"
auth = "x-api-key"
models = ["claude-opus-5"]
priority = 1
failure_threshold = 1
cooldown_secs = 30
envoy_cluster = "prov"

[server.envoy_failover]
"bedrock-then-prov" = ["bedrock", "prov"]
"prov-then-bedrock" = ["prov", "bedrock"]
"""
)
"""Bedrock first, then an API provider's account on its own cluster (Envoy: an aggregate)."""
CLOUD_CLUSTERS = frozenset(["bedrock"])
BODY = msgspec.json.encode(
    {"model": "claude-opus-5", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
)


@dataclass(frozen=True)
class Scenario:
    config: str
    upstream: Mapping[str, Behaviour]
    """How each key answers (a Bedrock account's: its access key id)."""
    own_answer: bool = False
    """Switchyard answers itself (an error of its own), not the upstream."""
    before: str = ""
    """"refused": every account's credentials were refused earlier."""
    served_by: tuple[str, str] | None = None
    """The (key, model id) of the attempt that served, when one did."""


SCENARIOS = {
    "a Bedrock account serves, signed": Scenario(
        BEDROCK, {FIRST_KEY: Behaviour()}, served_by=(FIRST_KEY, OPUS_US)
    ),
    "a Bedrock throttle: the next Bedrock account, under its own model id": Scenario(
        BEDROCK,
        {FIRST_KEY: Behaviour(status=429), SECOND_KEY: Behaviour()},
        served_by=(SECOND_KEY, OPUS_EU),
    ),
    "Bedrock's ResourceNotFound (the account's 502): the next Bedrock account": Scenario(
        BEDROCK,
        {FIRST_KEY: Behaviour(status=404), SECOND_KEY: Behaviour()},
        served_by=(SECOND_KEY, OPUS_EU),
    ),
    "Bedrock refuses the key (its 403): the next Bedrock account": Scenario(
        BEDROCK,
        {FIRST_KEY: Behaviour(status=401), SECOND_KEY: Behaviour()},
        served_by=(SECOND_KEY, OPUS_EU),
    ),
    "Bedrock's 500: the next Bedrock account": Scenario(
        BEDROCK,
        {FIRST_KEY: Behaviour(status=500), SECOND_KEY: Behaviour()},
        served_by=(SECOND_KEY, OPUS_EU),
    ),
    "every Bedrock account throttled: the last throttle in the API's shape": Scenario(
        BEDROCK, {FIRST_KEY: Behaviour(status=429), SECOND_KEY: Behaviour(status=429)}
    ),
    "a lone Bedrock account's ValidationException: the client's 400, no fault": Scenario(
        ONE_BEDROCK, {FIRST_KEY: Behaviour(status=400)}
    ),
    "every Bedrock key refused: the credential 503 at once": Scenario(
        BEDROCK,
        {FIRST_KEY: Behaviour(status=403), SECOND_KEY: Behaviour(status=401)},
        own_answer=True,
    ),
    "Bedrock throttled: the API provider's account serves, across clusters": Scenario(
        THEN_API,
        {FIRST_KEY: Behaviour(status=429), API_KEY: Behaviour()},
        served_by=(API_KEY, "claude-opus-5"),
    ),
    "Bedrock down: the API provider's account serves, across clusters": Scenario(
        THEN_API,
        {FIRST_KEY: Behaviour(status=503), API_KEY: Behaviour()},
        served_by=(API_KEY, "claude-opus-5"),
    ),
    "Bedrock's key refused earlier: the API provider from the first attempt": Scenario(
        THEN_API, {API_KEY: Behaviour()}, before="aws refused", served_by=(API_KEY, "claude-opus-5")
    ),
}


@pytest.fixture(autouse=True)
def aws_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each Bedrock account's AWS chain: the first's key in the environment, the second's in
    a shared credentials file under its profile; nothing of this machine's."""
    (tmp_path / "credentials").write_text(
        f"[second]\naws_access_key_id = {SECOND_KEY}\naws_secret_access_key = {SECOND_SECRET}\n"
    )
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", MOCK_AWS_ACCESS_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", MOCK_AWS_SECRET_ACCESS_KEY)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)


def _mock(scenario: Scenario) -> MockProvider:
    mock = MockProvider(
        aws_credentials={
            MOCK_AWS_ACCESS_KEY_ID: MOCK_AWS_SECRET_ACCESS_KEY,
            SECOND_KEY: SECOND_SECRET,
        }
    )
    for key, behaviour in scenario.upstream.items():
        mock.set_behaviour(key, behaviour)
    return mock


def _before(pool: AccountPool, scenario: Scenario) -> None:
    if scenario.before == "aws refused":
        lease = pool.acquire("claude-opus-5", allowed={"aws"})
        assert lease is not None
        pool.record(lease, Outcome.FAULT, Cause.CREDENTIALS)


def _sent(mock: MockProvider) -> list[tuple[str, str]]:
    """(key, model) of each request the mock answered: a Bedrock one's access key id (its
    signature verified) and the model id of its path."""
    return [(r.key, r.model or "") for r in mock.requests]


# --- the ASGI front, around the gateway's own forwarding app ------------------------------


async def through_asgi(scenario: Scenario, spans: InMemorySpanExporter) -> Decisions:
    mock = _mock(scenario)
    upstream = httpx.AsyncClient(transport=httpx.ASGITransport(app=mock))
    config = parse_config(scenario.config)
    stack = switchyard_stack(Forwarder(upstream), config=config, environ=ENV)
    _before(stack.pool, scenario)
    spans.clear()
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=stack), base_url="http://gw.test"
    ) as client:
        reply = await client.post(
            "/v1/messages", content=BODY, headers={"content-type": "application/json"}
        )
    await stack.aclose()
    await upstream.aclose()
    return Decisions(
        status=reply.status_code,
        error=error_of(reply.json()) if reply.status_code >= 400 else None,
        headers=kept_headers(reply.headers),
        attempts=attempt_spans(spans),
        calls=client_spans(spans),
        sent=_sent(mock),
    )


# --- the ext_proc front, through the example's upstream chain ----------------------------

UPSTREAM_FILTER = [("x-switchyard-filter", "upstream")]
CLOUD_FILTER = [("x-switchyard-filter", "cloud")]


def _refused_status(status: int) -> bool:
    """Whether envoy.yaml's matcher sends an answer of `status` to the refusal filter: 400,
    401-403, 429 and 5xx."""
    return status in (400, 401, 402, 403, 429) or status >= 500


async def _cloud_attempt(
    servicer: ExtProcServicer, mock: httpx.AsyncClient, out: Outgoing
) -> Answer:
    """One attempt on a cloud cluster: the cloud filter's stream around the upstream call."""
    cloud = Stream(servicer, CLOUD_FILTER)
    path = out.headers[":path"]
    extra = {k: v for k, v in out.headers.items() if not k.startswith(":")}
    await cloud.send(request_headers(path, extra={**extra, "x-request-id": RID}))
    out.apply(await cloud.send(request_body(out.body)))
    answer = await send_upstream(mock, out)
    mapped = await cloud.send(response_headers(answer.status, answer.headers))
    if mapped.HasField("mode_override"):  # an error, read whole and replaced
        mapped = await cloud.send(response_body(answer.body, end=True))
        answer.body = common(mapped).body_mutation.body or answer.body
    status = sets(mapped).get(":status")
    if status is not None:
        answer.status = int(status)
    await cloud.close()
    return answer


async def _refusal(servicer: ExtProcServicer, answer: Answer) -> bool:
    """The refusal filter on an attempt's answer: whether it asks Envoy for a retry."""
    upstream = Stream(servicer, UPSTREAM_FILTER)
    extra = {k: v for k, v in answer.headers.items() if k == "retry-after"}
    reply = await upstream.send(response_headers(answer.status, extra, request_id=RID))
    if reply.HasField("mode_override"):  # a 400 or 429 to read: its body, in one piece
        reply = await upstream.send(response_body(answer.body, end=True))
    await upstream.close()
    return sets(reply).get("x-switchyard-retry") == b"1"


async def _attempts(
    servicer: ExtProcServicer,
    mock: httpx.AsyncClient,
    routed: tuple[dict[str, str], bytes],
    order: tuple[str, ...],
) -> Answer:
    """Each attempt Envoy sends, following the retries the processor asks for; the last
    attempt's answer. `routed`: the request as the router-level stream let it go (Envoy
    replays it for each retry); `order`: the clusters of Envoy's attempts in turn."""
    attempt = 1
    while True:
        cluster = order[(attempt - 1) % len(order)]
        out = Outgoing(dict(routed[0]), routed[1])
        if attempt > 1:  # the retry filter: the retry's account, its credential and body
            retry = Stream(servicer, UPSTREAM_FILTER)
            named = cluster if len(order) > 1 else None
            out.apply(
                await retry.send(
                    upstream_headers({"x-request-id": RID}, attempt=attempt, cluster=named)
                )
            )
            out.apply(await retry.send(request_body(out.body)))
            await retry.close()
        if cluster in CLOUD_CLUSTERS:
            answer = await _cloud_attempt(servicer, mock, out)
        else:
            answer = await send_upstream(mock, out)
        if not _refused_status(answer.status) or not await _refusal(servicer, answer):
            return answer
        attempt += 1


async def through_extproc(scenario: Scenario, spans: InMemorySpanExporter) -> Decisions:
    config = parse_config(scenario.config)
    policies = Policies(config, build_accounts(config, ENV))
    _before(policies.pool, scenario)
    servicer = ExtProcServicer(policies)
    mock = _mock(scenario)
    spans.clear()
    router = Stream(servicer)
    client = {"content-type": "application/json", "x-api-key": "the-caller's"}
    await router.send(request_headers(extra={"x-request-id": RID, **client}))
    routed = await router.send(request_body(BODY))
    if routed.WhichOneof("response") == "immediate_response":
        await router.close()
        return _immediate(routed, spans)
    out = Outgoing({":path": "/v1/messages", **client}, BODY)
    out.apply(routed)
    cluster = out.headers["x-switchyard-cluster"]
    order = tuple(config.server.envoy_failover.get(cluster, [cluster]))
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=mock), base_url="http://upstream.test"
    ) as upstream:
        answer = await _attempts(servicer, upstream, (out.headers, out.body), order)
    # Envoy hands the router-level filter the last answer's headers, as the upstream filters
    # left them.
    final = await router.send(
        response_headers(answer.status, answer.headers, details="via_upstream")
    )
    await router.close()
    if final.WhichOneof("response") == "immediate_response":
        decisions = _immediate(final, spans)
        decisions.sent = _sent(mock)
        return decisions
    # The client gets the last answer's headers with the processor's set over them.
    return Decisions(
        answer.status,
        error=error_of(msgspec.json.decode(answer.body)) if answer.status >= 400 else None,
        headers=kept_headers({**answer.headers, **decoded(sets(final))}),
        attempts=attempt_spans(spans),
        calls=client_spans(spans),
        sent=_sent(mock),
    )


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
async def test_both_fronts_decide_alike_for_cloud_accounts(
    scenario: Scenario, otel_spans: InMemorySpanExporter
) -> None:
    asgi = await through_asgi(scenario, otel_spans)
    extproc = await through_extproc(scenario, otel_spans)
    assert asgi == extproc
    if scenario.served_by is not None:
        assert asgi.status == 200
        assert asgi.sent[-1] == scenario.served_by
    else:
        assert asgi.status >= 400
        assert asgi.error is not None
    assert len(asgi.calls) == len(asgi.attempts), "each attempt has its CLIENT span"
    if scenario.own_answer:
        assert asgi.headers.get("x-should-retry") == "false"
