"""The judge: request building, verdict parsing, and the middleware failing open for each reason.

The judge side is the mock provider under real uvicorn on loopback, so connect, header and
mid-body stalls are real network behaviour; the client side is in process (ASGITransport).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import msgspec
import pytest
import pytest_asyncio
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from servers import refusing_port, serving
from switchyard_mw.accounts import Account
from switchyard_mw.asgi._types import Message, Receive, Scope, Send
from switchyard_mw.asgi.judge_middleware import MAX_VERDICT_BYTES, JudgeMiddleware
from switchyard_mw.config import LLMClient, Route, parse_config
from switchyard_mw.core.judge_verdicts import BadVerdict, build_judge_request, parse_verdict
from switchyard_mw.errors import ConfigError
from switchyard_mw.telemetry import names as tm
from switchyard_mw.testing import Behaviour, MockProvider
from switchyard_mw.wire import Wire, last_user_text

LABELS = ["simple", "complex"]
FAIL_OPEN = tm.CLASSIFIER_FAIL_OPEN
PROMPT = "Prove that there are infinitely many primes."


# --- building the judge request --------------------------------------------------------------


def test_judge_request_lists_the_labels_and_carries_the_turn() -> None:
    body = msgspec.json.decode(
        build_judge_request(judge_model="gpt-j", labels=LABELS, user_text="hi", max_chars=100)
    )
    assert body["model"] == "gpt-j"
    assert body["temperature"] == 0
    assert body["stream"] is False
    assert 0 < body["max_tokens"] <= 32
    system, user = body["messages"]
    assert system["role"] == "system"
    assert "- simple\n- complex" in system["content"]
    assert "exactly one" in system["content"]
    assert user == {"role": "user", "content": "hi"}


def test_judge_request_truncates_long_text_and_says_so() -> None:
    text = "a" * 50 + "b" * 50
    body = msgspec.json.decode(
        build_judge_request(judge_model="j", labels=LABELS, user_text=text, max_chars=50)
    )
    content = body["messages"][1]["content"]
    assert content.startswith("a" * 50 + "\n")
    assert "b" not in content.split("\n")[0]
    assert "truncated" in content
    assert "50 of 100" in content


# --- reading the verdict ---------------------------------------------------------------------


def completion(content: Any) -> bytes:
    message = {"role": "assistant", "content": content}
    return msgspec.json.encode({"object": "chat.completion", "choices": [{"message": message}]})


def sse(*deltas: str, done: bool = True) -> bytes:
    frames = [
        b"data: "
        + msgspec.json.encode(
            {"object": "chat.completion.chunk", "choices": [{"delta": {"content": d}}]}
        )
        + b"\n\n"
        for d in deltas
    ]
    return b"".join(frames) + (b"data: [DONE]\n\n" if done else b"")


@pytest.mark.parametrize(
    "content",
    [
        "complex",
        "  complex\n",
        '"complex"',
        "'Complex'",
        "`complex`",
        "COMPLEX",
        '{"label": "complex"}',
        ' {"label": " Complex "} ',
    ],
)
def test_verdict_ignores_whitespace_quotes_and_case(content: str) -> None:
    assert parse_verdict(completion(content), LABELS) == "complex"


def test_verdict_is_returned_as_the_configured_label() -> None:
    assert parse_verdict(completion("hard"), ["Easy", "HARD"]) == "HARD"


def test_verdict_from_an_sse_stream() -> None:
    assert parse_verdict(sse("", "com", "plex", "\n"), LABELS) == "complex"
    role_first = b'data: {"choices":[{"delta":{"role":"assistant"}}]}\n\n' + sse("simple")
    assert parse_verdict(b"event: x\n: comment\n" + role_first, LABELS) == "simple"
    assert parse_verdict(sse("simple", done=False), LABELS) == "simple"


@pytest.mark.parametrize(
    "body",
    [
        completion("medium"),
        completion("complex."),
        completion("complex or simple"),
        completion(""),
        completion(None),
        completion('{"label": "medium"}'),
        completion('{"choice": "complex"}'),
        completion("{not json"),
        b'{"choices": []}',
        b'{"error": {"message": "boom"}}',
        b"[1, 2]",
        b"not json at all",
        b"",
        sse("med", "ium"),
        b'data: {"error": {"message": "overloaded"}}\n\n',
        b"data: {broken\n\n",
    ],
)
def test_anything_else_is_a_bad_verdict(body: bytes) -> None:
    with pytest.raises(BadVerdict):
        parse_verdict(body, LABELS)


# --- the last user turn ----------------------------------------------------------------------


def test_last_user_text_anthropic() -> None:
    body = msgspec.json.encode(
        {
            "model": "m",
            "max_tokens": 5,
            "messages": [
                {"role": "user", "content": "first"},
                {"role": "assistant", "content": "ok"},
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "base64", "data": "AAAA"}},
                        {"type": "text", "text": "describe", "cache_control": {"type": "x"}},
                        {"type": "text", "text": "briefly"},
                    ],
                },
            ],
        }
    )
    assert last_user_text(Wire.ANTHROPIC, body) == "describe\nbriefly"


def test_last_user_text_chat() -> None:
    body = msgspec.json.encode(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "be nice"},
                {"role": "user", "content": [{"type": "text", "text": "old"}]},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "latest"},
                {"role": "assistant", "content": None, "tool_calls": []},
            ],
        }
    )
    assert last_user_text(Wire.OPENAI_CHAT, body) == "latest"


def test_last_user_text_responses() -> None:
    def body(input_: Any) -> bytes:
        return msgspec.json.encode({"model": "m", "input": input_})

    assert last_user_text(Wire.OPENAI_RESPONSES, body("just a string")) == "just a string"
    items = [
        {"role": "user", "content": "one"},
        {"type": "function_call_output", "call_id": "c", "output": "x"},
        {
            "type": "message",
            "role": "user",
            "content": [
                {"type": "input_text", "text": "two"},
                {"type": "input_image", "image_url": "http://x"},
            ],
        },
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}]},
    ]
    assert last_user_text(Wire.OPENAI_RESPONSES, body(items)) == "two"
    assert last_user_text(Wire.OPENAI_RESPONSES, msgspec.json.encode({"model": "m"})) == ""


@pytest.mark.parametrize(
    ("wire", "body"),
    [
        (Wire.ANTHROPIC, b'{"model": "m", "messages": []}'),
        (Wire.ANTHROPIC, b'{"model": "m", "messages": [{"role": "assistant", "content": "x"}]}'),
        (Wire.OPENAI_CHAT, b'{"model": "m", "messages": [{"role": "user", "content": 7}]}'),
        (Wire.OPENAI_CHAT, b'{"model": "m", "messages": [{"role": "user"}]}'),
        (Wire.OPENAI_CHAT, b'{"model": "m", "messages": "odd"}'),
        (Wire.OPENAI_RESPONSES, b'{"model": "m", "input": [1, null, {"role": "user"}]}'),
        (Wire.OPENAI_RESPONSES, b'{"model": "m", "input": {"weird": true}}'),
        (Wire.GENERIC, b"not json"),
        (Wire.GENERIC, b"[]"),
    ],
)
def test_last_user_text_is_empty_for_odd_shapes(wire: Wire, body: bytes) -> None:
    assert last_user_text(wire, body) == ""


# --- config ----------------------------------------------------------------------------------

CONFIG = """
[llm_clients.judge]
base_url = "http://127.0.0.1:9"
models = ["*"]
[routes.auto]
classifier = "llm"
judge = "judge"
judge_model = "gpt-judge"
choices = {{ simple = "small", complex = "big" }}
fallback = "big"
{extra}
"""


@pytest.mark.parametrize("value", ["0", "-5"])
def test_non_positive_judge_deadline_is_rejected(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(CONFIG.format(extra=f"judge_deadline_ms = {value}"))
    assert "routes.auto.judge_deadline_ms: must be > 0" in info.value.problems


def test_judge_deadline_is_optional() -> None:
    assert parse_config(CONFIG.format(extra="")).routes["auto"].judge_deadline_ms is None
    config = parse_config(CONFIG.format(extra="judge_deadline_ms = 800"))
    assert config.routes["auto"].judge_deadline_ms == 800


# --- the middleware --------------------------------------------------------------------------


# One judge server for the module (starting and stopping uvicorn costs ~0.2 s); the tests that
# use it share its event loop, and each starts from a mock with no behaviours or records.
module_loop = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def judge_server() -> AsyncIterator[tuple[MockProvider, str]]:
    mock = MockProvider()
    async with serving(mock) as url:
        yield mock, url


@pytest.fixture
def mock(judge_server: tuple[MockProvider, str]) -> MockProvider:
    judge_server[0].reset()
    return judge_server[0]


@pytest.fixture
def judge_url(judge_server: tuple[MockProvider, str]) -> str:
    return judge_server[1]


@pytest.fixture
def closed_port() -> Iterator[str]:
    with refusing_port() as port:  # connecting is refused while the test runs
        yield f"http://127.0.0.1:{port}"


class InnerApp:
    """The app behind the middleware: records the body it got and echoes its model."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = await receive()
        body = message.get("body", b"")
        self.bodies.append(body)
        model = msgspec.json.decode(body)["model"] if body else None
        out = msgspec.json.encode({"model": model})
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": out})


def make_judge(
    url: str, key: str, *, deadline_ms: int | None = 2000, timeout_secs: float = 5.0
) -> tuple[InnerApp, JudgeMiddleware]:
    route = Route(
        classifier="llm",
        judge="judge",
        judge_model="gpt-judge",
        choices={"simple": "small-model", "complex": "big-model"},
        fallback="fallback-model",
        judge_deadline_ms=deadline_ms,
    )
    client = Account(
        name="judge", spec=LLMClient(base_url=url, models=["*"], timeout_secs=timeout_secs),
        api_key=key,
    )  # fmt: skip
    inner = InnerApp()
    return inner, JudgeMiddleware(inner, routes={"auto": route}, accounts={"judge": client})


def chat_body(model: str = "auto", text: str = PROMPT) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}]}


async def post(
    mw: JudgeMiddleware, body: dict[str, Any], headers: dict[str, str] | None = None
) -> httpx.Response:
    transport = httpx.ASGITransport(app=mw)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        return await client.post("/v1/chat/completions", json=body, headers=headers)


def fail_opens(metrics: Any) -> dict[str, float]:
    reasons = ["deadline", "http_error", "transport_error", "bad_verdict", "disconnect"]
    return {r: metrics.value(FAIL_OPEN, route="auto", reason=r) for r in reasons}


def assert_counted_once(metrics: Any, before: dict[str, float], reason: str) -> None:
    after = fail_opens(metrics)
    assert {r: after[r] - before[r] for r in after} == {
        r: (1.0 if r == reason else 0.0) for r in after
    }


async def until_idle(mock: MockProvider) -> None:
    """The mock stopped answering: our side hung up on the judge call."""
    async with asyncio.timeout(2):
        while mock.in_flight:  # noqa: ASYNC110 - polling a plain counter
            await asyncio.sleep(0.01)


@module_loop
async def test_a_judge_verdict_routes_to_its_model(
    mock: MockProvider, judge_url: str, otel_metrics: Any, otel_spans: InMemorySpanExporter
) -> None:
    mock.set_behaviour("k-ok", Behaviour(reply=" Complex\n"))
    inner, mw = make_judge(judge_url, "k-ok")
    before = fail_opens(otel_metrics)
    ok_before = otel_metrics.value(tm.JUDGE_DURATION, route="auto", outcome="ok")
    try:
        response = await post(mw, chat_body())
    finally:
        await mw.aclose()
    assert response.json() == {"model": "big-model"}
    assert msgspec.json.decode(inner.bodies[0])["model"] == "big-model"
    assert response.headers["x-switchyard-route"] == "judge:complex"
    assert response.headers["x-switchyard-model"] == "big-model"
    assert fail_opens(otel_metrics) == before
    assert otel_metrics.value(tm.JUDGE_DURATION, route="auto", outcome="ok") == ok_before + 1

    (call,) = mock.requests
    assert call.path == "/v1/chat/completions"
    assert call.model == "gpt-judge"
    assert call.headers["authorization"] == "Bearer k-ok"
    assert PROMPT in msgspec.json.decode(call.body)["messages"][1]["content"]

    (span,) = [s for s in otel_spans.get_finished_spans() if s.name == tm.SPAN_JUDGE]
    attrs = dict(span.attributes or {})
    assert attrs[tm.JUDGE_ROUTE] == "auto"
    assert attrs[tm.JUDGE_OUTCOME] == "ok"
    assert attrs[tm.JUDGE_LABEL] == "complex"
    assert attrs[tm.REQUEST_MODEL] == "gpt-judge"
    assert not any(PROMPT in str(v) for s in otel_spans.get_finished_spans()
                   for v in (s.attributes or {}).values())  # fmt: skip


@module_loop
async def test_the_pool_is_reused_across_requests(mock: MockProvider, judge_url: str) -> None:
    mock.set_behaviour("k-reuse", Behaviour(reply="simple"))
    _, mw = make_judge(judge_url, "k-reuse")
    try:
        first = (await post(mw, chat_body())).json()
        pool = mw._http
        second = (await post(mw, chat_body())).json()
        assert pool is not None
        assert mw._http is pool
    finally:
        await mw.aclose()
    assert first == second == {"model": "small-model"}
    assert mw._http is None


@module_loop
@pytest.mark.parametrize(
    ("behaviour", "reason"),
    [
        (Behaviour(status=500), "http_error"),
        (Behaviour(status=429), "http_error"),
        (Behaviour(reply="medium"), "bad_verdict"),
        (Behaviour(reply="x" * (MAX_VERDICT_BYTES + 1)), "bad_verdict"),
    ],
)
async def test_a_judge_that_answers_badly_fails_open(
    mock: MockProvider,
    judge_url: str,
    otel_metrics: Any,
    otel_spans: InMemorySpanExporter,
    behaviour: Behaviour,
    reason: str,
) -> None:
    mock.set_behaviour("k-bad", behaviour)
    inner, mw = make_judge(judge_url, "k-bad")
    before = fail_opens(otel_metrics)
    try:
        response = await post(mw, chat_body())
    finally:
        await mw.aclose()
    assert response.status_code == 200
    assert msgspec.json.decode(inner.bodies[0])["model"] == "fallback-model"
    assert response.headers["x-switchyard-route"] == f"fail_open:{reason}"
    assert_counted_once(otel_metrics, before, reason)
    (span,) = [s for s in otel_spans.get_finished_spans() if s.name == tm.SPAN_JUDGE]
    assert dict(span.attributes or {})[tm.JUDGE_REASON] == reason


@module_loop
async def test_connection_refused_is_a_transport_error(closed_port: str, otel_metrics: Any) -> None:
    _, mw = make_judge(closed_port, "k")
    before = fail_opens(otel_metrics)
    try:
        response = await post(mw, chat_body())
    finally:
        await mw.aclose()
    assert response.json() == {"model": "fallback-model"}
    assert response.headers["x-switchyard-route"] == "fail_open:transport_error"
    assert_counted_once(otel_metrics, before, "transport_error")


@module_loop
async def test_a_judge_duration_lands_in_a_bucket_that_fits_it(
    mock: MockProvider, judge_url: str, otel_metrics: Any
) -> None:
    # A judge taking at least 60 ms: the histogram must say about how long, not "under 5 s"
    # (the SDK's default buckets are for milliseconds; this histogram is in seconds).
    delay_secs = 0.06
    mock.set_behaviour("k-slowish", Behaviour(reply="simple", headers_delay_secs=delay_secs))
    _, mw = make_judge(judge_url, "k-slowish")
    _, before = otel_metrics.histogram(tm.JUDGE_DURATION, route="auto", outcome="ok")
    try:
        response = await post(mw, chat_body())
    finally:
        await mw.aclose()
    assert response.headers["x-switchyard-route"] == "judge:simple"
    bounds, after = otel_metrics.histogram(tm.JUDGE_DURATION, route="auto", outcome="ok")
    assert (bounds[0], bounds[-1]) == (0.005, 600)  # seconds, from 5 ms to 10 min
    added = [a - b for a, b in zip(after, before or [0] * len(after), strict=True)]
    assert sum(added) == 1
    bucket = added.index(1)
    assert 0 < bucket < len(bounds)  # neither "under the first bound" nor "over the last"
    low, high = bounds[bucket - 1], bounds[bucket]
    assert low >= delay_secs - 0.01  # the bucket holding a duration of at least the delay
    assert high <= 3 * low  # and narrow enough to tell one judge latency from another


@module_loop
@pytest.mark.parametrize(
    "behaviour",
    [Behaviour(headers_delay_secs=10), Behaviour(body_stall_secs=10)],
    ids=["no_headers", "stalled_mid_body"],
)
async def test_a_stalled_judge_fails_open_at_its_deadline(
    mock: MockProvider, judge_url: str, otel_metrics: Any, behaviour: Behaviour
) -> None:
    mock.set_behaviour("k-stall", behaviour)
    _, mw = make_judge(judge_url, "k-stall", deadline_ms=200)
    before = fail_opens(otel_metrics)
    started = time.monotonic()
    try:
        response = await post(mw, chat_body())
        elapsed = time.monotonic() - started
        await until_idle(mock)  # the judge call was abandoned, not left running
    finally:
        await mw.aclose()
    assert 0.2 <= elapsed < 1.0
    assert response.json() == {"model": "fallback-model"}
    assert response.headers["x-switchyard-route"] == "fail_open:deadline"
    assert_counted_once(otel_metrics, before, "deadline")
    assert otel_metrics.value(tm.JUDGE_DURATION, route="auto", outcome="deadline") >= 1


@module_loop
@pytest.mark.parametrize(
    ("deadline_ms", "timeout_secs", "headers"),
    [
        (5000, 5.0, {"x-switchyard-timeout-ms": "200"}),  # the budget is shorter
        (None, 5.0, {"x-switchyard-timeout-ms": "200"}),  # no judge deadline: the budget
        (None, 0.2, {}),  # neither: the judge client's own timeout_secs
    ],
)
async def test_the_deadline_is_capped_by_the_budget_and_the_client_timeout(
    mock: MockProvider,
    judge_url: str,
    otel_metrics: Any,
    deadline_ms: int | None,
    timeout_secs: float,
    headers: dict[str, str],
) -> None:
    mock.set_behaviour("k-slow", Behaviour(headers_delay_secs=10))
    _, mw = make_judge(judge_url, "k-slow", deadline_ms=deadline_ms, timeout_secs=timeout_secs)
    before = fail_opens(otel_metrics)
    started = time.monotonic()
    try:
        response = await post(mw, chat_body(), headers)
    finally:
        await mw.aclose()
    assert time.monotonic() - started < 1.0
    assert response.headers["x-switchyard-route"] == "fail_open:deadline"
    assert_counted_once(otel_metrics, before, "deadline")


@module_loop
async def test_a_client_that_leaves_during_the_judge_call(
    mock: MockProvider, judge_url: str, otel_metrics: Any
) -> None:
    mock.set_behaviour("k-away", Behaviour(headers_delay_secs=10))
    inner, mw = make_judge(judge_url, "k-away", deadline_ms=5000)
    body = msgspec.json.encode(chat_body())
    sent: list[Message] = []
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> Message:
        if messages:
            return messages.pop()
        await asyncio.sleep(0.2)
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [(b"content-type", b"application/json")],
    }
    before = fail_opens(otel_metrics)
    started = time.monotonic()
    try:
        await asyncio.wait_for(mw(scope, receive, send), 3)
        elapsed = time.monotonic() - started
        await until_idle(mock)  # the judge saw us hang up
    finally:
        await mw.aclose()
    assert elapsed < 1.0
    assert len(mock.requests) == 1
    assert inner.bodies == []
    assert sent == []
    assert_counted_once(otel_metrics, before, "disconnect")


@module_loop
async def test_other_models_pass_straight_through(mock: MockProvider, judge_url: str) -> None:
    _, mw = make_judge(judge_url, "k")
    try:
        response = await post(mw, chat_body(model="gpt-x"))
        transport = httpx.ASGITransport(app=mw)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            plain = await client.get("/health")
    finally:
        await mw.aclose()
    assert response.json() == {"model": "gpt-x"}
    assert "x-switchyard-route" not in response.headers
    assert plain.status_code == 200
    assert mock.requests == []
    assert mw._http is None  # never even built


@module_loop
async def test_lifespan_passes_through_and_closes_the_pool(
    mock: MockProvider, judge_url: str
) -> None:
    mock.set_behaviour("k-life", Behaviour(reply="simple"))
    events: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                events.append(message["type"])
                kind = message["type"].removeprefix("lifespan.")
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        await InnerApp()(scope, receive, send)

    route = make_judge(judge_url, "k-life")[1]._routes
    accounts = {"judge": Account(name="judge", spec=LLMClient(base_url=judge_url,
               models=["*"]), api_key="k-life")}  # fmt: skip
    mw = JudgeMiddleware(app, routes=route, accounts=accounts)
    assert (await post(mw, chat_body())).json() == {"model": "small-model"}
    pool = mw._http
    assert pool is not None
    assert not pool.is_closed

    inbox = asyncio.Queue[Message]()
    for kind in ("startup", "shutdown"):
        inbox.put_nowait({"type": f"lifespan.{kind}"})
    outbox: list[Message] = []

    async def send(message: Message) -> None:
        outbox.append(message)

    await mw({"type": "lifespan"}, inbox.get, send)
    assert events == ["lifespan.startup", "lifespan.shutdown"]
    assert [m["type"] for m in outbox] == [
        "lifespan.startup.complete",
        "lifespan.shutdown.complete",
    ]
    assert pool.is_closed


def test_a_route_needs_its_judge_client() -> None:
    route = Route(classifier="llm", judge="nope", judge_model="j", choices={"a": "m"}, fallback="m")
    with pytest.raises(ValueError, match="nope"):
        JudgeMiddleware(InnerApp(), routes={"auto": route}, accounts={})
