"""`x-switchyard-deadline-ms` reports the deadline in force, budget included: the example
gateway under uvicorn, called through the official SDKs, exporting its spans over OTLP to a
real receiver; the request span's `switchyard.deadline_ms` says the same as the header.

Before: a request with `x-switchyard-timeout-ms: 3000` was answered with
`x-switchyard-deadline-ms: 60000`, the attempt's own deadline, which the budget cut to 3 s.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from otlp_receiver import OtlpReceiver
from servers import example_gateway, serve_in_thread
from switchyard_mw.telemetry import names as tm
from switchyard_mw.testing import MockProvider

pytestmark = pytest.mark.integration

MESSAGES: Any = [{"role": "user", "content": "Say hello"}]
CONFIG = """
[llm_clients.a]
base_url = "{url}"
api_key_env = "KEY_A"
auth = "x-api-key"
models = ["m"]
timeout_secs = 60
"""
# budget headers -> (lowest, highest) deadline in ms the answer may report. The budget is
# counted from the request's arrival; the attempt starts a few ms later, with that much less.
CASES: dict[str, tuple[dict[str, str], tuple[int, int]]] = {
    "no budget": ({}, (60000, 60000)),
    "a longer budget": ({"x-switchyard-timeout-ms": "90000"}, (60000, 60000)),
    "a shorter budget": ({"x-switchyard-timeout-ms": "3000"}, (2500, 3000)),
    "Envoy's budget": ({"x-envoy-expected-rq-timeout-ms": "3000"}, (2500, 3000)),
    "the shorter of two": (
        {"x-envoy-expected-rq-timeout-ms": "9000", "x-switchyard-timeout-ms": "2000"},
        (1500, 2000),
    ),
}


class Gateway:
    def __init__(self, url: str, otlp: OtlpReceiver) -> None:
        self.url, self.otlp = url, otlp

    def deadline_ms_of(self, trace_id: str) -> int:
        """`switchyard.deadline_ms` on the request span of the trace `trace_id`."""
        span = self.otlp.wait_for(
            lambda o: next(
                (s for s in o.spans() if s.trace_id == trace_id and s.name == tm.SPAN_REQUEST),
                None,
            )
        )
        value = span.attributes[tm.DEADLINE_MS]
        assert isinstance(value, int)
        return value


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    mock = MockProvider()
    with OtlpReceiver() as otlp, serve_in_thread(mock) as mock_url:
        env = {
            "KEY_A": "key-a",
            "OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "100",
            "NO_PROXY": "127.0.0.1,localhost",
        }
        tmp = tmp_path_factory.mktemp("budget")
        with example_gateway(CONFIG.format(url=mock_url), tmp, env) as url:
            yield Gateway(url, otlp)


def traced(headers: dict[str, str]) -> tuple[str, dict[str, str]]:
    """`headers` plus a traceparent of a fresh trace, to find the request's span by."""
    trace_id = secrets.token_hex(16)
    return trace_id, {**headers, "traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}


@pytest.mark.parametrize("case", CASES)
async def test_openai_sees_the_deadline_in_force(gateway: Gateway, case: str) -> None:
    budget, (low, high) = CASES[case]
    trace_id, headers = traced(budget)
    async with openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="x") as client:
        reply = await client.chat.completions.with_raw_response.create(
            model="m", messages=MESSAGES, max_completion_tokens=8, extra_headers=headers
        )
    reported = int(reply.headers["x-switchyard-deadline-ms"])
    assert low <= reported <= high
    assert gateway.deadline_ms_of(trace_id) == reported


@pytest.mark.parametrize("case", CASES)
async def test_a_streams_time_to_start_is_cut_by_the_budget_too(
    gateway: Gateway, case: str
) -> None:
    budget, (low, high) = CASES[case]
    trace_id, headers = traced(budget)
    # The OpenAI SDK: in this process the Anthropic SDK traces its own calls (a tracer
    # provider is installed), and its traceparent replaces the one passed here.
    client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="x")
    async with (
        client,
        client.chat.completions.with_streaming_response.create(
            model="m", messages=MESSAGES, stream=True, extra_headers=headers
        ) as reply,
    ):
        await reply.read()
    reported = int(reply.headers["x-switchyard-deadline-ms"])
    assert low <= reported <= high  # timeout_secs (60 s) is a stream's time to start
    assert gateway.deadline_ms_of(trace_id) == reported
