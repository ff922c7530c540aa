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

A request on Envoy's hedge route (`HEDGE_SCENARIOS` and a Vertex one of `VERTEX_SCENARIOS`,
`[server] envoy_hedge`) is raced as test_two_fronts_hedge.py races it (`hedge_race`), each try
through its own cloud filter stream told the try's `x-envoy-attempt-count`: each try must go
out as its own account, a Bedrock exception in a racing try's stream must be that try's own,
and `switchyard.hedges` is compared too; a void try (no budget) is Envoy's only, checked on
its own.

One difference of the front, not in `sent`: a Vertex account whose token endpoint refused its
key gets no request through the ASGI front, while under Envoy its attempt still goes out,
empty (no prompt, no credential: an upstream filter cannot answer for the cluster and let the
route retry, docs/envoy.md#cloud-accounts); the mock's Vertex face refuses it unrecorded.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator, Mapping
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
from hedge_race import Call, Route, race
from metric_reading import Metrics
from servers import serve_in_thread
from switchyard_mw import switchyard_stack
from switchyard_mw.accounts import build_accounts
from switchyard_mw.config import parse_config
from switchyard_mw.core.pool import AccountPool, Cause, Outcome
from switchyard_mw.extproc import ExtProcServicer, Policies
from switchyard_mw.extproc.policy import HEDGE_HEADER
from switchyard_mw.telemetry import names as tm
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
ACCOUNTS = {FIRST_KEY: "aws", SECOND_KEY: "aws-second", GOOD: "gcp", OTHER: "gcp-other"}
"""The account each key (access key id, service account) is."""
HEDGE_SECS = 0.3


def _hedging(accounts: str) -> str:
    """`accounts`, each hedging after HEDGE_SECS without content; under Envoy, on the hedge
    route (`[server] envoy_hedge`)."""
    server = "[server]\nenvoy_hedge = true\nhedge_max_ratio = 1.0\n"
    hedging = f"cooldown_secs = 30\nhedge_after_secs = {HEDGE_SECS}\n"
    return server + accounts.replace("cooldown_secs = 30\n", hedging)


HEDGED = _hedging(BEDROCK)
"""BEDROCK, both accounts hedging after HEDGE_SECS without content; under Envoy, on the
hedge route (`[server] envoy_hedge`)."""
VERTEX_HEDGED = _hedging(VERTEX)
"""VERTEX, hedged as HEDGED."""
SLOW_STREAM = Behaviour(stall_after_chunks=0, body_stall_secs=2.0)
"""Headers and the opening events at once, the first content 2 s later: hedged long before."""
SLOW_JSON = Behaviour(headers_delay_secs=2.0)
"""A JSON answer 2 s late (its headers come with it)."""
SLOW_FIRST = Behaviour(stall_after_chunks=0, body_stall_secs=1.2)
"""A first content 1.2 s after the headers: hedged, yet in time to win over a failed rival."""


def _excepting(exception: str, after_secs: float = 0.0) -> Behaviour:
    """A Bedrock stream whose headers and opening events come at once and which, after
    `after_secs`, carries Bedrock's `exception` message before any content."""
    return Behaviour(
        fail="error_mid_stream",
        stall_after_chunks=0,
        body_stall_secs=after_secs,
        bedrock_exception=exception,
    )


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
    stream_error: str | None = None
    """The type of the `error` event a served stream ends with (None: it ends well)."""
    charged: tuple[str, str] | None = None
    """(account, status) of the fault the request charged (None: no fault, or not checked)."""
    hedged: Mapping[str, int] | None = None
    """`switchyard.hedges` counted, by result, for a request whose first try was hedged (its
    two tries both reached the mock)."""
    tries: tuple[tuple[str, str], ...] = ()
    """A hedged request's two tries as the mock must see them: (key, model) of each, its own
    account's (default: the two Bedrock accounts')."""


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
    "an InternalServerException after a Bedrock stream started: the error event, a 500 fault": (
        Scenario(
            BEDROCK,
            {
                FIRST_KEY: Behaviour(
                    fail="error_mid_stream",
                    stall_after_chunks=1,
                    bedrock_exception="InternalServerException",
                )
            },
            served_by=(FIRST_KEY, OPUS_US),
            stream=True,
            stream_error="api_error",
            charged=("aws", "500"),
        )
    ),
    "a ModelStreamErrorException after a Bedrock stream started: a 502 fault": Scenario(
        BEDROCK,
        {
            FIRST_KEY: Behaviour(
                fail="error_mid_stream",
                stall_after_chunks=2,
                bedrock_exception="ModelStreamErrorException",
            )
        },
        served_by=(FIRST_KEY, OPUS_US),
        stream=True,
        stream_error="api_error",
        charged=("aws", "502"),
    ),
    "an InternalServerException before a Bedrock stream's first content: the next account": (
        Scenario(
            BEDROCK,
            {
                FIRST_KEY: Behaviour(
                    fail="error_mid_stream",
                    stall_after_chunks=0,
                    bedrock_exception="InternalServerException",
                ),
                SECOND_KEY: Behaviour(),
            },
            served_by=(SECOND_KEY, OPUS_EU),
            stream=True,
            charged=("aws", "500"),
        )
    ),
    "a ThrottlingException before a Bedrock stream's first content: the next account": Scenario(
        BEDROCK,
        {
            FIRST_KEY: Behaviour(
                fail="error_mid_stream",
                stall_after_chunks=0,
                bedrock_exception="ThrottlingException",
            ),
            SECOND_KEY: Behaviour(),
        },
        served_by=(SECOND_KEY, OPUS_EU),
        stream=True,
    ),
    "an InternalServerException before content on every Bedrock account: the last stream's "
    "error event, each account's 500 fault": Scenario(
        BEDROCK,
        {
            FIRST_KEY: _excepting("InternalServerException"),
            SECOND_KEY: _excepting("InternalServerException"),
        },
        served_by=(SECOND_KEY, OPUS_EU),
        stream=True,
        stream_error="api_error",
    ),
    "a ThrottlingException after a Bedrock stream started: a throttle, no fault": Scenario(
        BEDROCK,
        {
            FIRST_KEY: Behaviour(
                fail="error_mid_stream",
                stall_after_chunks=1,
                bedrock_exception="ThrottlingException",
            )
        },
        served_by=(FIRST_KEY, OPUS_US),
        stream=True,
        stream_error="rate_limit_error",
    ),
}


HEDGE_SCENARIOS = {
    "a Bedrock stream slow to content: hedged on the next account, signed as that account": (
        Scenario(
            HEDGED,
            {FIRST_KEY: SLOW_STREAM, SECOND_KEY: Behaviour()},
            served_by=(SECOND_KEY, OPUS_EU),
            stream=True,
            hedged={"won": 1},
        )
    ),
    "a slow Bedrock JSON answer: hedged on the next account, signed as that account": Scenario(
        HEDGED,
        {FIRST_KEY: SLOW_JSON, SECOND_KEY: Behaviour()},
        served_by=(SECOND_KEY, OPUS_EU),
        hedged={"won": 1},
    ),
    "the Bedrock hedge throttled (its own key's 429) loses: the first stream answers": Scenario(
        HEDGED,
        {
            FIRST_KEY: SLOW_FIRST,
            SECOND_KEY: Behaviour(status=429),
        },
        served_by=(FIRST_KEY, OPUS_US),
        stream=True,
        hedged={"lost": 1},
    ),
    "an InternalServerException in the Bedrock hedge's stream before content: the hedge's "
    "500 fault, the first stream answers": Scenario(
        HEDGED,
        {FIRST_KEY: SLOW_FIRST, SECOND_KEY: _excepting("InternalServerException")},
        served_by=(FIRST_KEY, OPUS_US),
        stream=True,
        charged=("aws-second", "500"),
        hedged={"lost": 1},
    ),
    "a ThrottlingException in the Bedrock hedge's stream before content: a throttle, the "
    "first stream answers": Scenario(
        HEDGED,
        {FIRST_KEY: SLOW_FIRST, SECOND_KEY: _excepting("ThrottlingException")},
        served_by=(FIRST_KEY, OPUS_US),
        stream=True,
        hedged={"lost": 1},
    ),
    "a ModelStreamErrorException in the first Bedrock stream while the hedge races: its 502 "
    "fault, the hedge answers": Scenario(
        HEDGED,
        {
            FIRST_KEY: _excepting("ModelStreamErrorException", after_secs=HEDGE_SECS * 2),
            SECOND_KEY: SLOW_FIRST,
        },
        served_by=(SECOND_KEY, OPUS_EU),
        stream=True,
        charged=("aws", "502"),
        hedged={"won": 1},
    ),
    "an InternalServerException in the first Bedrock stream before the hedge time: its 500 "
    "fault, the next account": Scenario(
        HEDGED,
        {FIRST_KEY: _excepting("InternalServerException"), SECOND_KEY: Behaviour()},
        served_by=(SECOND_KEY, OPUS_EU),
        stream=True,
        charged=("aws", "500"),
    ),
    "no hedge budget: Envoy's second try goes out void, the first Bedrock stream answers": (
        Scenario(
            HEDGED.replace("hedge_max_ratio = 1.0", "hedge_max_ratio = 0.0"),
            {FIRST_KEY: SLOW_FIRST},
            served_by=(FIRST_KEY, OPUS_US),
            stream=True,
            hedged={"refused": 1},
        )
    ),
}
"""A Bedrock account's try hedged by Envoy's `hedge_policy` on the cloud cluster: each try
must go out enveloped and signed for its own account, and be translated as its own; a void
try (no hedge budget) neither signed nor enveloped, with no prompt."""
VOID = {"refused": 1}
"""The hedges of a request whose second try under Envoy went out void."""


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
    "a Vertex stream slow to content: hedged on the next account, with that account's token": (
        Scenario(
            VERTEX_HEDGED,
            {GOOD: SLOW_STREAM, OTHER: Behaviour()},
            served_by=(OTHER, VERTEX_OPUS_OTHER),
            stream=True,
            hedged={"won": 1},
            tries=((GOOD, VERTEX_OPUS), (OTHER, VERTEX_OPUS_OTHER)),
        )
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


class InPieces(httpx.AsyncBaseTransport):
    """The mock in process, its answer's body passed on piece by piece as it sends it
    (httpx's `ASGITransport` reads it whole first): a stream whose content reached the
    client before its error is one the client saw start, on either front."""

    def __init__(self, app: MockProvider) -> None:
        self.app = app

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        started: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        pieces: asyncio.Queue[bytes | None] = asyncio.Queue()
        done = asyncio.Event()
        asked = False

        async def receive() -> dict[str, Any]:
            nonlocal asked
            if not asked:
                asked = True
                return {"type": "http.request", "body": body, "more_body": False}
            await done.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                started.set_result(message)
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    await pieces.put(message["body"])
                if not message.get("more_body", False):
                    await pieces.put(None)

        async def run() -> None:
            try:
                await self.app(_scope(request), receive, send)
            finally:
                await pieces.put(None)

        task = asyncio.create_task(run())
        await asyncio.wait([started, task], return_when=asyncio.FIRST_COMPLETED)
        if not started.done():
            task.result()  # the app's own error, raised as through ASGITransport
        start = started.result()
        return httpx.Response(
            start["status"],
            headers=[(k, v) for k, v in start.get("headers", [])],
            stream=_Pieces(pieces, done, task),
        )


class _Pieces(httpx.AsyncByteStream):
    def __init__(
        self, pieces: asyncio.Queue[bytes | None], done: asyncio.Event, task: asyncio.Task[None]
    ) -> None:
        self.pieces, self.done, self.task = pieces, done, task

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while (piece := await self.pieces.get()) is not None:
            yield piece

    async def aclose(self) -> None:
        self.done.set()
        await self.task


def _scope(request: httpx.Request) -> dict[str, Any]:
    url = request.url
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": url.scheme,
        "path": url.path,
        "raw_path": url.raw_path.split(b"?", 1)[0],
        "query_string": url.query,
        "root_path": "",
        "headers": [(k.lower(), v) for k, v in request.headers.raw],
        "server": (url.host, url.port or 80),
        "client": ("127.0.0.1", 1),
    }


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
    """(key, model) of each request with a prompt the mock answered: a Bedrock one's access
    key id (its signature verified) and the model id of its path (a void try has neither:
    `_void`)."""
    return [(r.key, r.model) for r in mock.requests if r.model is not None]


def _void(mock: MockProvider) -> list[tuple[str, bytes]]:
    """(key, body) of each request without a model the mock got: a void try's (Envoy's
    second try of a hedged request with no account to give it, `hedge_tries`)."""
    return [(r.key, r.body) for r in mock.requests if r.model is None]


@dataclass(frozen=True)
class Read:
    """What the client read of the answer, and what the request left of each account."""

    text: str = ""
    """The answer's text (`text_of`)."""
    events: tuple[str, ...] = ()
    """A stream's SSE event types, in order."""
    stream_error: tuple[str, str] | None = None
    """(type, message) of the `error` event a stream ended with."""
    accounts: tuple[tuple[str, str, int, str, int], ...] = ()
    """Each account's breaker afterwards, and its pair's for the model: name, state,
    consecutive faults, the pair's state and consecutive faults."""


def _read(body: bytes, pool: AccountPool) -> Read:
    events: list[str] = []
    stream_error = None
    if not body.startswith(b"{"):
        for event in body.decode().split("\n\n"):
            lines = event.splitlines()
            kind = next((line[7:] for line in lines if line.startswith("event: ")), None)
            if kind is None:
                continue
            events.append(kind)
            if kind == "error":
                data = next(line[6:] for line in lines if line.startswith("data: "))
                stream_error = error_of(msgspec.json.decode(data))
    return Read(text_of(body), tuple(events), stream_error, _accounts(pool))


def _accounts(pool: AccountPool) -> tuple[tuple[str, str, int, str, int], ...]:
    found = []
    for name in pool.names:
        own, pair = pool.status_of(name), pool.status_of(name, model="claude-opus-5")
        found.append(
            (
                name,
                own.state.value,
                own.consecutive_faults,
                pair.state.value,
                pair.consecutive_faults,
            )
        )
    return tuple(found)


Series = dict[tuple[tuple[str, Any], ...], float]
"""A metric's data points by their attributes (`Metrics.series`)."""
COMPARED = (
    tm.OPERATION_DURATION,
    "switchyard.account.faults",
    "switchyard.account.cooled",
    tm.HEDGES,
)
"""The metrics whose points a request adds are compared: the request's (its account and
`error.type`), each account's faults (by status) and coolings, and the hedges by result."""


def _series(metrics: Metrics) -> dict[str, Series]:
    return {name: metrics.series(name) for name in COMPARED}


def _added(before: dict[str, Series], metrics: Metrics) -> dict[str, Series]:
    """What each of `COMPARED` gained since `before` (`_series`), by attributes."""
    added: dict[str, Series] = {}
    for name, now in _series(metrics).items():
        was = before[name]
        gained = {k: n - was.get(k, 0.0) for k, n in now.items() if n != was.get(k, 0.0)}
        if gained:
            added[name] = gained
    return added


# --- the ASGI front, around the gateway's own forwarding app ------------------------------


async def through_asgi(run: Run, spans: InMemorySpanExporter) -> tuple[Decisions, Read]:
    _ready(run.mock, run.scenario)
    upstream = httpx.AsyncClient(transport=InPieces(run.mock))
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
    return decisions, _read(reply.content, stack.pool)


# --- the ext_proc front, through the example's upstream chain ----------------------------

UPSTREAM_FILTER = [("x-switchyard-filter", "upstream")]
CLOUD_FILTER = [("x-switchyard-filter", "cloud")]


def _streams(answer: Answer) -> bool:
    return answer.status < 300 and answer.headers.get("content-type", "").startswith(
        "text/event-stream"
    )


async def _sent_in_pieces(mock: httpx.AsyncClient, out: Outgoing) -> tuple[Answer, list[bytes]]:
    """`out` sent as Envoy sends it (to the mock provider in process), its answer's body in
    the pieces it came in (at least one)."""
    headers = {k: v for k, v in out.headers.items() if not k.startswith(":")}
    headers["host"] = out.headers.get(":authority", "upstream.test")  # what Envoy sends
    request = mock.build_request("POST", out.headers[":path"], content=out.body, headers=headers)
    reply = await mock.send(request, stream=True)
    pieces = [piece async for piece in reply.aiter_raw()] or [b""]
    await reply.aclose()
    return Answer(reply.status_code, dict(reply.headers), b"".join(pieces)), pieces


def _ends(pieces: list[bytes]) -> Iterator[tuple[bytes, bool]]:
    """Each piece, and whether it is the body's last (its `end_of_stream`)."""
    for index, piece in enumerate(pieces):
        yield piece, index == len(pieces) - 1


async def _cloud_attempt(
    servicer: ExtProcServicer, mock: httpx.AsyncClient, out: Outgoing
) -> tuple[Answer, list[bytes], bool]:
    """One attempt on a cloud cluster: the cloud filter's stream around the upstream call.
    The answer as the filter left it, its body's pieces (an event stream's turned into SSE
    piece by piece, each going on to the first-token filter before the next comes, as Envoy
    streams it), and whether the first-token filter asked for a retry."""
    cloud = Stream(servicer, CLOUD_FILTER)
    path = out.headers[":path"]
    extra = {k: v for k, v in out.headers.items() if not k.startswith(":")}
    await cloud.send(request_headers(path, extra={**extra, "x-request-id": RID}))
    out.apply(await cloud.send(request_body(out.body)))
    answer, pieces = await _sent_in_pieces(mock, out)
    mapped = await cloud.send(response_headers(answer.status, answer.headers))
    for name in removes(mapped):
        answer.headers.pop(name, None)
    answer.headers.update(decoded(sets(mapped)))
    retry = False
    if mapped.HasField("mode_override") and answer.status >= 300:  # an error, read whole
        mapped = await cloud.send(response_body(answer.body, end=True))
        answer.body = common(mapped).body_mutation.body or answer.body
        answer.headers.update(decoded(sets(mapped)))
        pieces = [answer.body]
    elif mapped.HasField("mode_override"):  # an event stream, to SSE piece by piece
        answer.status = int(answer.headers.pop(":status", answer.status))
        held = FirstToken(servicer, answer)
        sse = []
        for piece, end in _ends(pieces):
            sse.append(common(await cloud.send(response_body(piece, end=end))).body_mutation.body)
            await held.feed(sse[-1], end)
        retry = await held.released()
        answer.body, pieces = b"".join(sse), sse
    answer.status = int(answer.headers.pop(":status", answer.status))
    await cloud.close()
    return answer, pieces, retry


def _changed(answer: Answer, mapped: Any) -> None:
    """`answer` as the cloud filter's answer `mapped` left it (its headers and status)."""
    for name in removes(mapped):
        answer.headers.pop(name, None)
    answer.headers.update(decoded(sets(mapped)))
    answer.status = int(answer.headers.pop(":status", answer.status))


def _through_cloud(servicer: ExtProcServicer, mock: httpx.AsyncClient) -> Any:
    """The calls of a hedged request's tries on a cloud cluster (`hedge_race.Calls`): each
    try's cloud filter stream around its upstream call, the try told by its own
    `x-envoy-attempt-count` as Envoy sends it (the example's virtual host includes it, and
    the cloud filter forwards every header); the answer mapped or translated piece by piece
    by that stream as it comes."""

    @contextlib.asynccontextmanager
    async def call(out: Outgoing, number: int) -> AsyncIterator[Call]:
        cloud = Stream(servicer, CLOUD_FILTER)
        try:
            extra = {k: v for k, v in out.headers.items() if not k.startswith(":")}
            extra |= {"x-request-id": RID, "x-envoy-attempt-count": str(number)}
            await cloud.send(request_headers(out.headers[":path"], extra=extra))
            enveloped = await cloud.send(request_body(out.body))
            # An upstream filter's own answer would go straight to the client (measured,
            # docs/envoy.md#cloud-accounts): never for a try of a request that races.
            assert enveloped.WhichOneof("response") == "request_body", "the cloud filter answered"
            out.apply(enveloped)
            headers = {k: v for k, v in out.headers.items() if not k.startswith(":")}
            headers["host"] = out.headers.get(":authority", "upstream.test")
            request = mock.build_request(
                "POST", out.headers[":path"], content=out.body, headers=headers
            )
            reply = await mock.send(request, stream=True)
            try:
                answer = Answer(reply.status_code, dict(reply.headers), b"")
                mapped = await cloud.send(response_headers(answer.status, answer.headers))
                _changed(answer, mapped)
                if mapped.HasField("mode_override") and answer.status >= 300:  # read whole
                    body = await reply.aread()
                    mapped = await cloud.send(response_body(body, end=True))
                    _changed(answer, mapped)
                    yield Call(answer, _one(common(mapped).body_mutation.body or body))
                elif mapped.HasField("mode_override"):  # an event stream, to SSE
                    yield Call(answer, _translated(cloud, reply))
                else:
                    yield Call(answer, reply.aiter_raw())
            finally:
                await reply.aclose()
        finally:
            await cloud.close()

    return call


async def _one(body: bytes) -> AsyncIterator[bytes]:
    yield body


async def _translated(cloud: Stream, reply: httpx.Response) -> AsyncIterator[bytes]:
    """A cloud's stream through its cloud filter's stream, piece by piece as it comes."""
    async for piece in reply.aiter_raw():
        yield common(await cloud.send(response_body(piece))).body_mutation.body
    yield common(await cloud.send(response_body(b"", end=True))).body_mutation.body


async def _hedged(
    servicer: ExtProcServicer,
    mock: httpx.AsyncClient,
    routed: Outgoing,
    order: tuple[str, ...],
) -> tuple[Answer, list[bytes]]:
    """A request on the hedge route (`x-switchyard-hedge`): Envoy's tries race as
    `hedge_race` plays them, each through the cloud filter; the winner's answer and its body
    (in one piece)."""
    per_try = int(routed.headers["x-envoy-upstream-rq-per-try-timeout-ms"]) / 1000
    assert per_try == HEDGE_SECS
    route = Route(servicer, _through_cloud(servicer, mock), routed, order, RID, hedged=True)
    winner, _ = await race(route, per_try)
    assert winner.reply is None
    assert winner.answer is not None
    return winner.answer, [winner.answer.body]


class FirstToken:
    """The first-token filter's stream on a 2xx stream's answer (its headers held until its
    first content), fed piece by piece: each piece is taken before the next is fed, as the
    filters before it in Envoy's chain (the cloud filter) see the next only after."""

    def __init__(self, servicer: ExtProcServicer, answer: Answer) -> None:
        self.stream = Pushed(servicer)
        self.stream.inbox.put_nowait(
            response_headers(answer.status, answer.headers, request_id=RID)
        )
        self.first = asyncio.ensure_future(self.stream.next(within=5.0))

    async def feed(self, piece: bytes, end: bool) -> None:
        inbox = self.stream.inbox
        await inbox.put(response_body(piece, end=end))
        for _ in range(20):  # taken and answered: a few steps of the loop (no I/O)
            await asyncio.sleep(0)
        assert inbox.empty()

    async def released(self) -> bool:
        """Whether the held headers were answered with a retry (the stream failed before
        its content went on)."""
        released = await self.first
        assert released.WhichOneof("response") == "response_headers", "released at its content"
        await self.stream.close()
        return sets(released).get("x-switchyard-retry") == b"1"


async def _first_token(servicer: ExtProcServicer, answer: Answer, pieces: list[bytes]) -> bool:
    """The first-token filter on a 2xx stream of an API provider's: whether it asked for a
    retry."""
    held = FirstToken(servicer, answer)
    for piece, end in _ends(pieces):
        await held.feed(piece, end)
    return await held.released()


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
) -> tuple[Answer, list[bytes]]:
    """Each attempt Envoy sends, following the retries the processor asks for; the last
    attempt's answer and its body's pieces. `routed`: the request as the router-level stream
    let it go (Envoy replays it for each retry); `order`: the clusters of Envoy's attempts in
    turn."""
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
            answer, pieces, retry = await _cloud_attempt(servicer, mock, out)
        else:
            answer, pieces = await _sent_in_pieces(mock, out)
            retry = _streams(answer) and await _first_token(servicer, answer, pieces)
        if retry:
            attempt += 1
            continue
        if not refusal_matched(answer.status) or not await _refusal(servicer, answer):
            return answer, pieces
        attempt += 1


async def through_extproc(run: Run, spans: InMemorySpanExporter) -> tuple[Decisions, Read]:
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
        return _immediate(routed, spans), Read(accounts=_accounts(policies.pool))
    out = Outgoing({":path": "/v1/messages", **client}, run.body)
    out.apply(routed)
    cluster = out.headers["x-switchyard-cluster"]
    order = tuple(config.server.envoy_failover.get(cluster, [cluster]))
    async with httpx.AsyncClient(
        transport=InPieces(run.mock), base_url="http://upstream.test"
    ) as upstream:
        if out.headers.get(HEDGE_HEADER) == "1":  # Envoy's hedge route
            answer, pieces = await _hedged(servicer, upstream, out, order)
        else:
            answer, pieces = await _attempts(servicer, upstream, (out.headers, out.body), order)
    # Envoy hands the router-level filter the last answer's headers, as the upstream filters
    # left them (and its body piece by piece, when the processor asks for it).
    final = await router.send(
        response_headers(answer.status, answer.headers, details="via_upstream")
    )
    if final.HasField("mode_override") and final.WhichOneof("response") == "response_headers":
        if final.mode_override.response_body_mode == final.mode_override.BUFFERED:
            pieces = [answer.body]  # asked for whole: Envoy sends it in one message
        for piece, end in _ends(pieces):
            await router.send(response_body(piece, end=end))
    await router.close()
    if final.WhichOneof("response") == "immediate_response":
        decisions = _immediate(final, spans)
        decisions.sent = _sent(run.mock)
        return decisions, Read(accounts=_accounts(policies.pool))
    # The client gets the last answer's headers with the processor's set over them.
    decisions = Decisions(
        answer.status,
        error=error_of(msgspec.json.decode(answer.body)) if answer.status >= 400 else None,
        headers=kept_headers({**answer.headers, **decoded(sets(final))}),
        attempts=attempt_spans(spans),
        calls=client_spans(spans),
        sent=_sent(run.mock),
    )
    return decisions, _read(answer.body, policies.pool)


def _immediate(answer: Any, spans: InMemorySpanExporter) -> Decisions:
    status, headers, body = immediate(answer)
    return Decisions(
        status,
        error=error_of(body),
        headers=kept_headers(decoded(headers)),
        attempts=attempt_spans(spans),
        calls=client_spans(spans),
    )


async def _compare(run: Run, spans: InMemorySpanExporter, metrics: Metrics) -> None:
    before = _series(metrics)
    asgi, asgi_read = await through_asgi(run, spans)
    asgi_added = _added(before, metrics)
    before = _series(metrics)
    extproc, extproc_read = await through_extproc(run, spans)
    assert asgi.sent == extproc.sent, "each try's (key, model id), as the mock verified them"
    assert asgi == extproc
    assert asgi_read == extproc_read
    assert asgi_added == _added(before, metrics)
    # A void try (Envoy's only: the ASGI front sends none) reached the cloud with no key and
    # no prompt, neither signed nor enveloped as the first try's account.
    scenario = run.scenario
    assert _void(run.mock) == ([("", b"")] if scenario.hedged == VOID else [])
    if scenario.charged is not None:
        account, status = scenario.charged
        faults = asgi_added["switchyard.account.faults"]
        assert faults == {tuple(sorted({tm.ACCOUNT: account, "status": status}.items())): 1.0}
    if scenario.stream_error is not None:
        assert asgi_read.stream_error is not None
        assert asgi_read.stream_error[0] == scenario.stream_error
        assert asgi_read.events[-1] == "error"
    if scenario.hedged is not None:
        # Both tries reached the cloud, each signed with (or holding the token of) its own
        # account's key, under its own model name.
        tries = list(scenario.tries or [(FIRST_KEY, OPUS_US), (SECOND_KEY, OPUS_EU)])
        assert asgi.sent == tries[: 1 if scenario.hedged == VOID else 2]
        hedges = asgi_added.get(tm.HEDGES, {})
        by_result = {dict(k)["result"]: n for k, n in hedges.items()}
        assert by_result == scenario.hedged
        assert scenario.served_by is not None
        assert asgi.headers["x-switchyard-account"] == ACCOUNTS[scenario.served_by[0]]
    elif scenario.served_by is not None:
        assert asgi.sent[-1] == scenario.served_by
    if scenario.served_by is not None:
        assert asgi.status == 200
        # The answer's text reached the client, unless its stream ended in an error first.
        assert asgi_read.text or scenario.stream_error is not None
    else:
        assert asgi.status >= 400
        assert asgi.error is not None
    assert len(asgi.calls) == len(asgi.attempts), "each attempt has its CLIENT span"
    if scenario.own_answer:
        assert asgi.headers.get("x-should-retry") == "false"


@pytest.mark.parametrize("scenario", SCENARIOS.values(), ids=SCENARIOS.keys())
async def test_both_fronts_decide_alike_for_bedrock_accounts(
    scenario: Scenario, otel_spans: InMemorySpanExporter, otel_metrics: Metrics
) -> None:
    await _compare(Run(scenario, scenario.config, cloud_mock()), otel_spans, otel_metrics)


@pytest.mark.parametrize("scenario", HEDGE_SCENARIOS.values(), ids=HEDGE_SCENARIOS.keys())
async def test_both_fronts_hedge_a_bedrock_account_alike(
    scenario: Scenario, otel_spans: InMemorySpanExporter, otel_metrics: Metrics
) -> None:
    await _compare(Run(scenario, scenario.config, cloud_mock()), otel_spans, otel_metrics)


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
    otel_metrics: Metrics,
) -> None:
    mock, places = vertex
    config = scenario.config
    for name, value in places.items():
        config = config.replace(name, value)
    await _compare(Run(scenario, config, mock), otel_spans, otel_metrics)
