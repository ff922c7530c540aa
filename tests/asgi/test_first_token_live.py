"""A stream starts at its first content event; a stream that trickles is cut at its floor.

Through the example gateway under uvicorn, with the official SDKs. Account `late` sends its
headers and opening events at once and its first token after `SILENCE_SECS` (issue 35, row 5):
with `first_token_secs` it is failed over before the client saw a byte of it, and `fast`
answers. Account `trickle` sends one small delta a second, under `min_tokens_per_sec`: its
stream ends with the wire's error event (phase `slow`), which the SDK raises.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from servers import example_gateway, serve_in_thread
from switchyard_mw.testing import Behaviour, MockProvider

pytestmark = pytest.mark.integration

FIRST_TOKEN_SECS = 0.5
SILENCE_SECS = 10.0
"""When `late` sends its first token: twenty times its limit."""
LATE = Behaviour(reply="late late late", stall_after_chunks=0, body_stall_secs=SILENCE_SECS)
FAST = Behaviour(reply="fast fast fast")
TRICKLE_GAP_SECS = 1.0
FLOOR, WINDOW_SECS = 2.0, 3.0
"""2 tokens/s over 3 s; `trickle` makes about 0.5 a second (2 characters a delta)."""
PATIENT_FIRST_TOKEN_SECS = 3.0
PATIENT = Behaviour(reply="worth the wait", stall_after_chunks=0, body_stall_secs=1.6)
"""Its first token after 1.6 s: past its `timeout_secs` and `stream_idle_secs` (and the
app's own read bound of those), within its `first_token_secs`."""
TRICKLE = Behaviour(reply="ab" * 20, chunks=20, chunk_interval_secs=TRICKLE_GAP_SECS)

CONFIG = f"""
[llm_clients.late]
base_url = "{{mock}}"
api_key_env = "KEY_LATE"
auth = "x-api-key"
models = ["ft-stream"]
timeout_secs = 30
stream_idle_secs = 30
first_token_secs = {FIRST_TOKEN_SECS}
failure_threshold = 100000

[llm_clients.late_json]
base_url = "{{mock}}"
api_key_env = "KEY_LATE"
auth = "x-api-key"
models = ["ft-json"]
timeout_secs = {FIRST_TOKEN_SECS}
failure_threshold = 100000

[llm_clients.trickle]
base_url = "{{mock}}"
api_key_env = "KEY_TRICKLE"
auth = "x-api-key"
models = ["ft-slow"]
stream_idle_secs = 30
min_tokens_per_sec = {FLOOR}
throughput_window_secs = {WINDOW_SECS}
failure_threshold = 100000

[llm_clients.patient]
base_url = "{{mock}}"
api_key_env = "KEY_PATIENT"
auth = "x-api-key"
models = ["ft-patient"]
timeout_secs = 0.3
stream_idle_secs = 0.3
first_token_secs = {PATIENT_FIRST_TOKEN_SECS}

[llm_clients.fast]
base_url = "{{mock}}"
api_key_env = "KEY_FAST"
auth = "x-api-key"
models = ["ft-stream", "ft-json"]
priority = 1
"""


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, MockProvider]]:
    provider = MockProvider()
    provider.set_behaviour("key-late", LATE)
    provider.set_behaviour("key-fast", FAST)
    provider.set_behaviour("key-trickle", TRICKLE)
    provider.set_behaviour("key-patient", PATIENT)
    env = {
        "KEY_LATE": "key-late",
        "KEY_FAST": "key-fast",
        "KEY_TRICKLE": "key-trickle",
        "KEY_PATIENT": "key-patient",
    }
    with serve_in_thread(provider) as mock_url:
        config = CONFIG.replace("{mock}", mock_url)
        with example_gateway(config, tmp_path_factory.mktemp("ft"), env) as url:
            yield url, provider


def _metric(gateway: str, name: str, *labels: str) -> float:
    total = 0.0
    for line in httpx.get(f"{gateway}/metrics").text.splitlines():
        series, _, value = line.rpartition(" ")
        if series.startswith(name + "{") and all(label in series for label in labels):
            total += float(value)
    return total


def _counts(gateway: str, account: str, phase: str) -> tuple[float, float]:
    faults = _metric(
        gateway,
        "switchyard_account_faults_total",
        f'switchyard_account="{account}"',
        'status="deadline"',
    )
    return faults, _metric(gateway, "switchyard_deadline_exceeded_total", f'phase="{phase}"')


def _settled(gateway: str, account: str, phase: str, expected: tuple[float, float]) -> object:
    end = time.monotonic() + 10
    seen = _counts(gateway, account, phase)
    while seen != expected and time.monotonic() < end:
        time.sleep(0.05)
        seen = _counts(gateway, account, phase)
    return seen


def _anthropic_stream(url: str) -> str:
    client = anthropic.Anthropic(base_url=url, api_key="caller", max_retries=0, timeout=30)
    text = ""
    with client.messages.stream(
        model="ft-stream", max_tokens=64, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        for piece in stream.text_stream:
            text += piece
    return text


def _chat_stream(url: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="caller", max_retries=0, timeout=30)
    text = ""
    for chunk in client.chat.completions.create(
        model="ft-stream", messages=[{"role": "user", "content": "hi"}], stream=True
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    return text


def _responses_stream(url: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="caller", max_retries=0, timeout=30)
    text = ""
    for event in client.responses.create(model="ft-stream", input="hi", stream=True):
        if event.type == "response.output_text.delta":
            text += event.delta
    return text


def _anthropic_json(url: str) -> str:
    client = anthropic.Anthropic(base_url=url, api_key="caller", max_retries=0, timeout=30)
    message = client.messages.create(
        model="ft-json", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
    )
    return "".join(block.text for block in message.content if block.type == "text")


def _chat_json(url: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="caller", max_retries=0, timeout=30)
    answer = client.chat.completions.create(
        model="ft-json", max_completion_tokens=8, messages=[{"role": "user", "content": "hi"}]
    )
    return answer.choices[0].message.content or ""


CALLS = {
    "anthropic-stream": (_anthropic_stream, "late", "first_token"),
    "chat-stream": (_chat_stream, "late", "first_token"),
    "responses-stream": (_responses_stream, "late", "first_token"),
    # Not a stream: the first token is the body, bounded by the attempt's total deadline.
    "anthropic-json": (_anthropic_json, "late_json", "total"),
    "chat-json": (_chat_json, "late_json", "total"),
}


@pytest.mark.parametrize("case", list(CALLS))
def test_a_late_first_token_fails_over_before_the_client_saw_a_byte(
    gateway: tuple[str, MockProvider], case: str
) -> None:
    url, provider = gateway
    call, account, phase = CALLS[case]
    before = _counts(url, account, phase)
    started = time.monotonic()
    text = call(url)
    took = time.monotonic() - started
    assert text == FAST.reply  # the fast account's answer, and nothing of the late one's
    # Well before the late first token, with a margin for a loaded machine.
    assert FIRST_TOKEN_SECS <= took < SILENCE_SECS / 2
    keys = [r.key for r in provider.requests[-2:]]
    assert keys == ["key-late", "key-fast"]
    # The late account's fault, of its phase.
    assert _settled(url, account, phase, (before[0] + 1, before[1] + 1)) == (
        before[0] + 1,
        before[1] + 1,
    )


def _outcome_of(call: object) -> str:
    try:
        call()  # type: ignore[operator]
    except anthropic.APIStatusError as exc:
        error = exc.body.get("error", {}) if isinstance(exc.body, dict) else {}
        return str(error.get("type"))
    return "none"


def test_a_trickling_stream_is_cut_at_its_floor(gateway: tuple[str, MockProvider]) -> None:
    url, _ = gateway
    before = _counts(url, "trickle", "slow")
    client = anthropic.Anthropic(base_url=url, api_key="caller", max_retries=0, timeout=60)
    got: list[str] = []
    started = time.monotonic()

    def call() -> None:
        with client.messages.stream(
            model="ft-slow", max_tokens=64, messages=[{"role": "user", "content": "hi"}]
        ) as stream:
            for piece in stream.text_stream:
                got.append(piece)

    outcome = _outcome_of(call)
    took = time.monotonic() - started
    assert outcome == "deadline_exceeded"  # the SDK raised the stream's error event
    # A window after the first token, never the 20 s the whole trickle would take.
    assert WINDOW_SECS <= took < WINDOW_SECS + 3 * TRICKLE_GAP_SECS
    assert 0 < len(got) < 20
    assert _settled(url, "trickle", "slow", (before[0] + 1, before[1] + 1)) == (
        before[0] + 1,
        before[1] + 1,
    )


def test_a_first_token_within_its_limit_is_waited_for(gateway: tuple[str, MockProvider]) -> None:
    url, _ = gateway
    client = anthropic.Anthropic(base_url=url, api_key="caller", max_retries=0, timeout=30)
    started = time.monotonic()
    with client.messages.stream(
        model="ft-patient", max_tokens=64, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        text = "".join(stream.text_stream)
    assert text == PATIENT.reply
    assert time.monotonic() - started >= PATIENT.body_stall_secs
