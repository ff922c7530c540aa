"""The example gateway's telemetry end to end: uvicorn in a subprocess, exporting over OTLP/HTTP
to a real receiver, calling the mock provider (in this process, so it records what it got).

One run covers a failover that cools an account, a judge failing open on a stream, a deadline
expiry and a refused connection; then every byte exported and every log line is scanned for secrets.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from otlp_receiver import OtlpReceiver, ReceivedSpan
from servers import ROOT, example_gateway, refusing_port, serve_in_thread
from switchyard_mw.telemetry import names as tm
from switchyard_mw.testing import Behaviour, MockProvider

pytestmark = pytest.mark.integration  # starts real servers

KEYS = {
    "KEY_A": "sk-live-secret-a-1111",
    "KEY_B": "sk-live-secret-b-2222",
    "KEY_J": "sk-live-secret-j-3333",
    "KEY_S": "sk-live-secret-s-4444",
}
CALLER_KEY = "sk-live-caller-5555"
PROMPT = "the secret plan for project walrus-9931"
USER_ID = "live-user-raw-id-6677"
SECRETS = (*KEYS.values(), CALLER_KEY, PROMPT, USER_ID)
CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"


def config(mock_url: str, down_url: str) -> str:
    return f"""
[llm_clients.down]
base_url = "{down_url}"
models = ["gpt-5"]
priority = -1

[llm_clients.a]
base_url = "{mock_url}"
api_key_env = "KEY_A"
auth = "x-api-key"
models = ["claude-opus-5", "claude-opus-5-5"]
priority = 0
failure_threshold = 1
cooldown_secs = 300

[llm_clients.b]
base_url = "{mock_url}"
api_key_env = "KEY_B"
models = ["claude-opus-5", "claude-opus-5-5", "gpt-5"]
priority = 1

[llm_clients.judge]
base_url = "{mock_url}"
api_key_env = "KEY_J"
models = ["gpt-judge"]

[llm_clients.slow]
base_url = "{mock_url}"
api_key_env = "KEY_S"
models = ["slow-model"]
timeout_secs = 0.3
failure_threshold = 100

[canaries."claude-opus-5"]
variants = {{ "claude-opus-5-5" = 50.0 }}

[routes.auto]
classifier = "llm"
judge = "judge"
judge_model = "gpt-judge"
judge_deadline_ms = 2000
choices = {{ simple = "claude-opus-5" }}
fallback = "claude-opus-5"
"""


class Run:
    def __init__(self, otlp: OtlpReceiver, mock: MockProvider, log: Path, url: str) -> None:
        self.otlp, self.mock, self.log, self.url = otlp, mock, log, url
        self.replies: dict[str, httpx.Response] = {}
        self.metrics_text = ""


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    tmp = tmp_path_factory.mktemp("otel")
    mock = MockProvider()
    mock.set_behaviour(KEYS["KEY_A"], Behaviour(status=500))
    mock.set_behaviour(KEYS["KEY_J"], Behaviour(status=500))
    mock.set_behaviour(KEYS["KEY_S"], Behaviour(headers_delay_secs=2))
    # The down account's port refuses connections for the module (`refusing_port`).
    with OtlpReceiver() as otlp, serve_in_thread(mock) as mock_url, refusing_port() as refused:
        env = {
            **KEYS,
            "OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint,
            "OTEL_SERVICE_NAME": "switchyard-e2e",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
            "OTEL_METRIC_EXPORT_INTERVAL": "300",
            "NO_PROXY": "127.0.0.1,localhost",
        }
        down_url = f"http://127.0.0.1:{refused}"  # a connection error
        with example_gateway(config(mock_url, down_url), tmp, env) as url:
            result = Run(otlp, mock, tmp / "gateway.log", url)
            with httpx.Client(base_url=url, timeout=30) as client:
                result.replies["failover"] = client.post(
                    "/v1/messages",
                    json={
                        "model": "claude-opus-5",
                        "max_tokens": 64,
                        "metadata": {"user_id": USER_ID},
                        "messages": [{"role": "user", "content": PROMPT}],
                    },
                    headers={
                        "x-api-key": CALLER_KEY,
                        "traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01",
                    },
                )
                result.replies["judge"] = client.post(
                    "/v1/chat/completions",
                    json={
                        "model": "auto",
                        "stream": True,
                        "user": USER_ID,
                        "messages": [{"role": "user", "content": PROMPT}],
                    },
                    headers={"authorization": f"Bearer {CALLER_KEY}"},
                )
                result.replies["deadline"] = client.post(
                    "/v1/messages",
                    json={
                        "model": "slow-model",
                        "max_tokens": 8,
                        "messages": [{"role": "user", "content": PROMPT}],
                    },
                    headers={"x-api-key": CALLER_KEY},
                )
                result.replies["refused"] = client.post(
                    "/v1/responses",
                    json={"model": "gpt-5", "input": PROMPT, "user": USER_ID},
                    headers={"authorization": f"Bearer {CALLER_KEY}"},
                )
            # Everything the run makes must be exported before the gateway stops.
            otlp.wait_for(lambda o: len(requests(o)) == 4 or None)
            otlp.wait_for(lambda o: {tm.DEADLINE_EXCEEDED, tm.ACCOUNT_COOLED} <= metric_names(o))
            result.metrics_text = httpx.get(f"{url}/metrics").text
        yield result


def requests(otlp: OtlpReceiver) -> list[ReceivedSpan]:
    """The request spans of LLM calls (not those of the /metrics scrapes)."""
    return [
        s for s in otlp.spans() if s.name == tm.SPAN_REQUEST and tm.REQUEST_MODEL in s.attributes
    ]


def metric_names(otlp: OtlpReceiver) -> set[str]:
    return {name for name, _ in otlp.metric_points()}


def trace_of(run: Run, trace_id: str) -> dict[str, list[ReceivedSpan]]:
    spans: dict[str, list[ReceivedSpan]] = {}
    for span in run.otlp.spans():
        if span.trace_id == trace_id:
            spans.setdefault(span.name, []).append(span)
    for group in spans.values():
        group.sort(key=lambda s: s.span.start_time_unix_nano)
    return spans


def test_the_failover_trace_arrives_whole_and_reaches_the_provider(run: Run) -> None:
    reply = run.replies["failover"]
    assert reply.status_code == 200
    assert reply.headers["x-switchyard-attempts"] == "2"
    spans = trace_of(run, CALLER_TRACE)  # the caller's trace, continued
    (request,) = spans[tm.SPAN_REQUEST]
    attempts, calls = spans[tm.SPAN_ATTEMPT], spans[tm.SPAN_OUTBOUND]
    assert (len(attempts), len(calls)) == (2, 2)
    assert request.parent_id == CALLER_SPAN
    assert request.resource["service.name"] == "switchyard-e2e"
    clients = spans[tm.SPAN_CLIENT.format(model=reply.headers["x-switchyard-model"])]
    assert len(clients) == 2  # each attempt's GenAI CLIENT span, between it and its call
    for attempt, client, call in zip(attempts, clients, calls, strict=True):
        assert attempt.parent_id == request.span_id
        assert client.parent_id == attempt.span_id
        assert call.parent_id == client.span_id
    assert [a.attributes[tm.ATTEMPT_OUTCOME] for a in attempts] == ["fault", "success"]
    assert [a.attributes[tm.ACCOUNT] for a in attempts] == ["a", "b"]
    assert [c.attributes[tm.HTTP_STATUS] for c in calls] == [500, 200]
    attributes = request.attributes
    assert attributes[tm.ACCOUNT] == "b"
    assert attributes[tm.ATTEMPTS] == 2
    assert attributes[tm.REQUEST_MODEL] == "claude-opus-5"
    assert attributes[tm.RESPONSE_MODEL] == reply.headers["x-switchyard-model"]
    assert attributes[tm.DEADLINE_MS] == int(reply.headers["x-switchyard-deadline-ms"])
    assert attributes[tm.USAGE_OUTPUT_TOKENS] == reply.json()["usage"]["output_tokens"]

    # The provider got a traceparent naming the very call span of each attempt.
    sent = [
        r.headers["traceparent"]
        for r in run.mock.requests
        if r.headers.get("traceparent", "").startswith(f"00-{CALLER_TRACE}-")
    ]
    assert [t.split("-")[2] for t in sent] == [c.span_id for c in calls]


def test_the_judge_failing_open_is_on_the_streamed_requests_trace(run: Run) -> None:
    reply = run.replies["judge"]
    assert reply.status_code == 200
    assert reply.headers["x-switchyard-route"] == "fail_open:http_error"
    (request,) = [
        s for s in requests(run.otlp) if s.attributes.get(tm.ROUTE) == "fail_open:http_error"
    ]
    spans = trace_of(run, request.trace_id)
    (judge,) = spans[tm.SPAN_JUDGE]
    (attempt,) = spans[tm.SPAN_ATTEMPT]  # account a is cooling: straight to b
    (call,) = spans[tm.SPAN_OUTBOUND]
    (client,) = [s for name, group in spans.items() if name.startswith("chat ") for s in group]
    assert judge.parent_id == attempt.parent_id == request.span_id
    assert client.parent_id == attempt.span_id
    assert call.parent_id == client.span_id
    assert judge.attributes[tm.JUDGE_REASON] == "http_error"
    assert attempt.attributes[tm.ACCOUNT] == "b"


def test_a_deadline_expiry_names_its_phase(run: Run) -> None:
    reply = run.replies["deadline"]
    assert reply.status_code == 504
    (request,) = [s for s in requests(run.otlp) if s.attributes[tm.REQUEST_MODEL] == "slow-model"]
    (attempt,) = trace_of(run, request.trace_id)[tm.SPAN_ATTEMPT]
    assert attempt.attributes[tm.DEADLINE_PHASE] == "total"
    assert attempt.attributes[tm.ATTEMPT_STATUS] == "deadline"
    assert request.attributes[tm.DEADLINE_PHASE] == "total"
    assert request.attributes[tm.HTTP_STATUS] == 504


def test_a_refused_connection_is_an_attempt_with_its_error(run: Run) -> None:
    reply = run.replies["refused"]
    assert reply.status_code == 200
    (request,) = [s for s in requests(run.otlp) if s.attributes[tm.REQUEST_MODEL] == "gpt-5"]
    spans = trace_of(run, request.trace_id)
    refused, answered = spans[tm.SPAN_ATTEMPT]
    assert refused.attributes[tm.ATTEMPT_STATUS] == "connect_error"
    assert refused.attributes[tm.ERROR_TYPE] == "ConnectError"
    assert answered.attributes[tm.ACCOUNT] == "b"
    assert [c.attributes.get(tm.ERROR_TYPE) for c in spans[tm.SPAN_OUTBOUND]] == [
        "ConnectError",
        None,
    ]
    assert request.attributes[tm.USAGE_INPUT_TOKENS] == reply.json()["usage"]["input_tokens"]


def test_metrics_arrive_over_otlp_and_on_metrics(run: Run) -> None:
    points = list(run.otlp.metric_points())
    assert (tm.CLASSIFIER_FAIL_OPEN, {"route": "auto", "reason": "http_error"}) in points
    assert (tm.ACCOUNT_COOLED, {tm.ACCOUNT: "a"}) in points
    assert (tm.DEADLINE_EXCEEDED, {"phase": "total"}) in points
    text = run.metrics_text
    # Each series the docs' dashboard queries read exists under that name on /metrics.
    doc = (ROOT / "docs" / "telemetry.md").read_text()
    labels = {label.replace(".", "_") for f in tm.METRIC_LABELS.values() for label in f}
    queried = set(re.findall(r"\bswitchyard_\w+", "\n".join(promql_blocks(doc)))) - labels
    assert queried
    exposed = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] != "#"}
    assert queried <= exposed


def promql_blocks(doc: str) -> list[str]:
    return re.findall(r"```promql\n(.*?)```", doc, flags=re.DOTALL)


def test_nothing_exported_or_logged_holds_a_key_a_prompt_or_a_user_id(run: Run) -> None:
    exported: list[Any] = [body for _, body in run.otlp.raw]
    assert any(b"switchyard.attempt" in body for body in exported)  # the scan sees the spans
    assert any(tm.short_hash(USER_ID).encode() in body for body in exported)
    log = run.log.read_bytes()
    # the scan reads the gateway's real log output: the failed attempt's record is in it
    assert b"attempt failed" in log
    assert b"account=down" in log
    for secret in SECRETS:
        assert not [body for body in exported if secret.encode() in body], secret
        assert secret.encode() not in log, secret
