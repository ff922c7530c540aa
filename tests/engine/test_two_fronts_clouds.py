"""Bedrock and Vertex accounts through both fronts make the same decisions (the comparison of
test_two_fronts.py, for cloud accounts).

Both fronts send every attempt to the mock provider in process: its Bedrock face re-signs each
request with botocore and refuses any mismatch, and records the access key id and the model id
of the path; its Vertex face takes only a token its token endpoint issued, and records the
service account and the version name of the path. So "what the upstream got" is who signed
(or held the token) and the model name it went under, on either front. The Vertex tests serve
that mock on a thread too: google-auth fetches an account's token over HTTP.

- The ASGI front runs the whole stack around the gateway's own forwarding app
  (`gateway.Forwarder`), which re-envelopes and authenticates a cloud attempt, turns
  Bedrock's event stream into SSE and maps a cloud's errors (the small forwarding app of
  test_two_fronts.py knows no cloud).
- The ext_proc front is driven as Envoy drives the example's upstream chain, attempt by
  attempt: the router-level stream routes the request; a retry's request headers and body go
  through the retry filter (which gives the retry its account, and its cluster through an
  aggregate); on a cloud cluster the cloud filter's stream re-envelopes and authenticates the
  body (`extproc.cloud`); the request then goes to the mock as Envoy would send it, with the
  headers and body those answers made; the mock's answer goes back through the cloud filter
  (an error read whole and mapped, a Bedrock stream turned into SSE), the first-token filter
  (a 2xx stream: its headers held to its first content) and the refusal filter when its
  status is one envoy.yaml's matcher passes; a retry mark starts the next attempt, else the
  router-level stream gets the last answer.

Compared as in test_two_fronts.py, and more: the error a cloud's refusal reaches the client as
(its type and text, mapped by the same code on either front) and the answer's text (a stream's
through the SSE it became).

One difference of the front, not in `sent`: a Vertex account whose token endpoint refused its
key gets no request through the ASGI front, while under Envoy its attempt still goes out,
empty (no prompt, no credential: an upstream filter cannot answer for the cluster and let the
route retry, docs/envoy.md#cloud-accounts); the mock's Vertex face refuses it unrecorded.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from machine_moves import machine_moves  # noqa: F401 (autouse: each move is a row)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from extproc_helpers import (
    Pushed,
    Stream,
    common,
    immediate,
    removes,
    request_body,
    request_headers,
    response_body,
    response_headers,
    sets,
    upstream_headers,
)
from servers import serve_in_thread
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
    post_through,
    refusal_matched,
    send_upstream,
    text_of,
)
from vertex_accounts import service_account_file

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
VERTEX_OPUS = "claude-opus-5@20260101"
VERTEX_OPUS_OTHER = "claude-opus-5@20260202"
GOOD, OTHER, REVOKED = (
    f"{name}@my-project.iam.gserviceaccount.com" for name in ("good", "other", "revoked")
)
"""The Vertex accounts' service accounts; the mock's token endpoint refuses REVOKED's key."""
VERTEX = "".join(
    f"""
[llm_clients.{name}]
kind = "vertex"
base_url = "@MOCK@"
vertex = {{ project = "my-project", region = "us-east5", credentials_file = "@{holder}@" }}
models = {{ "claude-opus-5" = "{model}" }}
priority = {i}
failure_threshold = 1
cooldown_secs = 30
envoy_cluster = "vertex"
"""
    for i, (name, holder, model) in enumerate(
        [("gcp", GOOD, VERTEX_OPUS), ("gcp-other", OTHER, VERTEX_OPUS_OTHER)]
    )
)
"""Two Vertex accounts on one cloud cluster, each under its own version name; `@MOCK@` and
each service account's `@email@` are the served mock's URL and key files (`vertex`)."""
VERTEX_REVOKED_FIRST = VERTEX.replace(f"@{GOOD}@", f"@{REVOKED}@", 1)
"""As VERTEX, the first account's key revoked at the token endpoint."""
CLOUD_CLUSTERS = frozenset(["bedrock", "vertex"])
BODY = msgspec.json.encode(
    {"model": "claude-opus-5", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
)
STREAM_BODY = msgspec.json.encode({**msgspec.json.decode(BODY), "stream": True})


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
    stream: bool = False


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
    "a Bedrock stream reaches the client as SSE": Scenario(
        BEDROCK, {FIRST_KEY: Behaviour()}, served_by=(FIRST_KEY, OPUS_US), stream=True
    ),
    "a Bedrock stream throttled: the next Bedrock account's stream": Scenario(
        BEDROCK,
        {FIRST_KEY: Behaviour(status=429), SECOND_KEY: Behaviour()},
        served_by=(SECOND_KEY, OPUS_EU),
        stream=True,
    ),
    "a Bedrock stream throttled: the API provider's stream, across clusters": Scenario(
        THEN_API,
        {FIRST_KEY: Behaviour(status=429), API_KEY: Behaviour()},
        served_by=(API_KEY, "claude-opus-5"),
        stream=True,
    ),
    "Bedrock's key refused earlier: the API provider from the first attempt": Scenario(
        THEN_API, {API_KEY: Behaviour()}, before="aws refused", served_by=(API_KEY, "claude-opus-5")
    ),
}


VERTEX_SCENARIOS = {
    "a Vertex account serves with its token": Scenario(
        VERTEX, {GOOD: Behaviour()}, served_by=(GOOD, VERTEX_OPUS)
    ),
    "Vertex's RESOURCE_EXHAUSTED: the next Vertex account, under its own version name": Scenario(
        VERTEX,
        {GOOD: Behaviour(status=429), OTHER: Behaviour()},
        served_by=(OTHER, VERTEX_OPUS_OTHER),
    ),
    "Vertex's 503: the next Vertex account": Scenario(
        VERTEX,
        {GOOD: Behaviour(status=503), OTHER: Behaviour()},
        served_by=(OTHER, VERTEX_OPUS_OTHER),
    ),
    "a Vertex key refused at the token endpoint: the next account, no prompt sent": Scenario(
        VERTEX_REVOKED_FIRST, {OTHER: Behaviour()}, served_by=(OTHER, VERTEX_OPUS_OTHER)
    ),
    "every Vertex account exhausted: the last refusal in the API's shape": Scenario(
        VERTEX, {GOOD: Behaviour(status=429), OTHER: Behaviour(status=429)}
    ),
    "a Vertex stream": Scenario(
        VERTEX, {GOOD: Behaviour()}, served_by=(GOOD, VERTEX_OPUS), stream=True
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


def cloud_mock() -> MockProvider:
    """The mock provider, its Bedrock face knowing both access keys."""
    secrets = {MOCK_AWS_ACCESS_KEY_ID: MOCK_AWS_SECRET_ACCESS_KEY, SECOND_KEY: SECOND_SECRET}
    return MockProvider(aws_credentials=secrets)


def _ready(mock: MockProvider, scenario: Scenario) -> None:
    """The mock answering as `scenario` says, no request recorded (tokens issued stay)."""
    mock.reset_behaviours()
    mock.clear_requests()
    for key, behaviour in scenario.upstream.items():
        mock.set_behaviour(key, behaviour)


@dataclass(frozen=True)
class Run:
    """One scenario's run: its config's text and the mock provider its accounts call."""

    scenario: Scenario
    config: str
    mock: MockProvider

    @property
    def body(self) -> bytes:
        return STREAM_BODY if self.scenario.stream else BODY


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


async def through_asgi(run: Run, spans: InMemorySpanExporter) -> tuple[Decisions, str]:
    _ready(run.mock, run.scenario)
    upstream = httpx.AsyncClient(transport=httpx.ASGITransport(app=run.mock))
    stack = switchyard_stack(Forwarder(upstream), config=parse_config(run.config), environ=ENV)
    _before(stack.pool, run.scenario)
    spans.clear()
    reply = await post_through(stack, upstream, run.body)
    decisions = Decisions(
        status=reply.status_code,
        error=error_of(reply.json()) if reply.status_code >= 400 else None,
        headers=kept_headers(reply.headers),
        attempts=attempt_spans(spans),
        calls=client_spans(spans),
        sent=_sent(run.mock),
    )
    return decisions, text_of(reply.content)


# --- the ext_proc front, through the example's upstream chain ----------------------------

UPSTREAM_FILTER = [("x-switchyard-filter", "upstream")]
CLOUD_FILTER = [("x-switchyard-filter", "cloud")]


def _streams(answer: Answer) -> bool:
    return answer.status < 300 and answer.headers.get("content-type", "").startswith(
        "text/event-stream"
    )


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
    for name in removes(mapped):
        answer.headers.pop(name, None)
    answer.headers.update(decoded(sets(mapped)))
    if mapped.HasField("mode_override"):  # an error read whole, or an event stream to SSE
        mapped = await cloud.send(response_body(answer.body, end=True))
        answer.body = common(mapped).body_mutation.body or answer.body
        answer.headers.update(decoded(sets(mapped)))
    answer.status = int(answer.headers.pop(":status", answer.status))
    await cloud.close()
    return answer


async def _first_token(servicer: ExtProcServicer, answer: Answer) -> None:
    """The first-token filter on a 2xx stream: its headers held until its first content."""
    stream = Pushed(servicer)
    await stream.inbox.put(response_headers(answer.status, answer.headers, request_id=RID))
    await stream.inbox.put(response_body(answer.body, end=True))
    released = await stream.next()
    assert released.WhichOneof("response") == "response_headers", "released at its content"
    assert "x-switchyard-retry" not in sets(released)
    await stream.close()


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
            headers = upstream_headers({"x-request-id": RID}, attempt=attempt, cluster=named)
            out.apply(await retry.send(headers))
            out.apply(await retry.send(request_body(out.body)))
            await retry.close()
        if cluster in CLOUD_CLUSTERS:
            answer = await _cloud_attempt(servicer, mock, out)
        else:
            answer = await send_upstream(mock, out)
        if _streams(answer):
            await _first_token(servicer, answer)
        if not refusal_matched(answer.status) or not await _refusal(servicer, answer):
            return answer
        attempt += 1


async def through_extproc(run: Run, spans: InMemorySpanExporter) -> tuple[Decisions, str]:
    config = parse_config(run.config)
    policies = Policies(config, build_accounts(config, ENV))
    _before(policies.pool, run.scenario)
    servicer = ExtProcServicer(policies)
    _ready(run.mock, run.scenario)
    spans.clear()
    router = Stream(servicer)
    client = {"content-type": "application/json", "x-api-key": "the-caller's"}
    await router.send(request_headers(extra={"x-request-id": RID, **client}))
    routed = await router.send(request_body(run.body))
    if routed.WhichOneof("response") == "immediate_response":
        await router.close()
        return _immediate(routed, spans), ""
    out = Outgoing({":path": "/v1/messages", **client}, run.body)
    out.apply(routed)
    cluster = out.headers["x-switchyard-cluster"]
    order = tuple(config.server.envoy_failover.get(cluster, [cluster]))
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=run.mock), base_url="http://upstream.test"
    ) as upstream:
        answer = await _attempts(servicer, upstream, (out.headers, out.body), order)
    # Envoy hands the router-level filter the last answer's headers, as the upstream filters
    # left them (and its body, when the processor asks for it).
    final = await router.send(
        response_headers(answer.status, answer.headers, details="via_upstream")
    )
    if final.HasField("mode_override") and final.WhichOneof("response") == "response_headers":
        await router.send(response_body(answer.body, end=True))
    await router.close()
    if final.WhichOneof("response") == "immediate_response":
        decisions = _immediate(final, spans)
        decisions.sent = _sent(run.mock)
        return decisions, ""
    # The client gets the last answer's headers with the processor's set over them.
    decisions = Decisions(
        answer.status,
        error=error_of(msgspec.json.decode(answer.body)) if answer.status >= 400 else None,
        headers=kept_headers({**answer.headers, **decoded(sets(final))}),
        attempts=attempt_spans(spans),
        calls=client_spans(spans),
        sent=_sent(run.mock),
    )
    return decisions, text_of(answer.body)


def _immediate(answer: Any, spans: InMemorySpanExporter) -> Decisions:
    status, headers, body = immediate(answer)
    return Decisions(
        status,
        error=error_of(body),
        headers=kept_headers(decoded(headers)),
        attempts=attempt_spans(spans),
        calls=client_spans(spans),
    )


async def _compare(run: Run, spans: InMemorySpanExporter) -> None:
    asgi, asgi_text = await through_asgi(run, spans)
    extproc, extproc_text = await through_extproc(run, spans)
    assert asgi == extproc
    assert asgi_text == extproc_text
    scenario = run.scenario
    if scenario.served_by is not None:
        assert asgi.status == 200
        assert asgi.sent[-1] == scenario.served_by
        assert asgi_text, "the answer's text reached the client"
    else:
        assert asgi.status >= 400
        assert asgi.error is not None
    assert len(asgi.calls) == len(asgi.attempts), "each attempt has its CLIENT span"
    if scenario.own_answer:
        assert asgi.headers.get("x-should-retry") == "false"


@pytest.mark.parametrize("scenario", SCENARIOS.values(), ids=SCENARIOS.keys())
async def test_both_fronts_decide_alike_for_bedrock_accounts(
    scenario: Scenario, otel_spans: InMemorySpanExporter
) -> None:
    await _compare(Run(scenario, scenario.config, cloud_mock()), otel_spans)


@pytest.fixture(scope="module")
def vertex(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[MockProvider, dict[str, str]]]:
    """The mock provider served (google-auth fetches a Vertex account's token over HTTP from
    its token endpoint; the LLM calls go to the same instance in process), and what the
    configs' `@...@` stand for: its URL and each service account's key file (REVOKED's key
    not trusted)."""
    pytest.importorskip("google.auth")
    mock = cloud_mock()
    keys = tmp_path_factory.mktemp("keys")
    with serve_in_thread(mock) as url:
        files = {
            email: str(
                service_account_file(keys, mock if email != REVOKED else None, url, email=email)
            )
            for email in (GOOD, OTHER, REVOKED)
        }
        yield mock, {"@MOCK@": url, **{f"@{email}@": path for email, path in files.items()}}


@pytest.mark.integration
@pytest.mark.parametrize("scenario", VERTEX_SCENARIOS.values(), ids=VERTEX_SCENARIOS.keys())
async def test_both_fronts_decide_alike_for_vertex_accounts(
    scenario: Scenario,
    vertex: tuple[MockProvider, dict[str, str]],
    otel_spans: InMemorySpanExporter,
) -> None:
    mock, places = vertex
    config = scenario.config
    for name, value in places.items():
        config = config.replace(name, value)
    await _compare(Run(scenario, config, mock), otel_spans)
