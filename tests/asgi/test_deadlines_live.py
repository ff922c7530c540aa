"""Deadlines through the example gateway under uvicorn, each phase fired again and again.

A deadline is decided by one timer, the deadline policy's alarm: a stream that keeps talking is
never cut by `timeout_secs`, and an expiry always ends as `deadline_exceeded` with its phase,
in the client's answer, in `switchyard.deadline.exceeded` and in `switchyard.account.faults`.
The forwarder's own transport timers used to race that alarm (a stream cut with
`upstream_error`, counted as fault "502" and missing from the idle count), so each phase runs
20 times: a race shows as a mixed outcome.

One gateway serves every case; each case has a model of its own on an account of its own, and
the mock provider misbehaves per account key.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from servers import example_gateway, serve_in_thread
from switchyard_mw.testing import Behaviour, MockProvider

pytestmark = pytest.mark.integration

BOUND_SECS = 0.3
"""Every short bound: `timeout_secs`, `stream_idle_secs`, the budget."""
SILENCE_SECS = 5.0
"""How long the mock keeps quiet where a bound must fire (it is cancelled once it does)."""
GAP_SECS = 0.6
"""The pause between chunks of a healthy stream: longer than `timeout_secs`..."""
PATIENT_IDLE_SECS = 2.5
"""...and well under its `stream_idle_secs`."""
ROUNDS, AT_ONCE = 2, 10
"""Each phase fires ROUNDS * AT_ONCE times: rounds one after another, each round concurrent."""

# account name -> (model, key, timeout_secs, stream_idle_secs, how the mock answers)
ACCOUNTS: dict[str, tuple[str, str, float, float, Behaviour]] = {
    "late": (
        "m-late",
        "key-late",
        BOUND_SECS,
        BOUND_SECS,
        Behaviour(headers_delay_secs=SILENCE_SECS),
    ),
    "silent": (
        "m-silent",
        "key-silent",
        BOUND_SECS,
        BOUND_SECS,
        Behaviour(chunks=3, stall_after_chunks=1, body_stall_secs=SILENCE_SECS),
    ),
    "patient": (
        "m-patient",
        "key-patient",
        BOUND_SECS,
        PATIENT_IDLE_SECS,
        Behaviour(reply="one two three", chunks=3, chunk_interval_secs=GAP_SECS),
    ),
    "roomy": (
        "m-roomy",
        "key-roomy",
        30.0,
        30.0,
        Behaviour(headers_delay_secs=SILENCE_SECS),
    ),
}


def config(mock_url: str) -> str:
    blocks = []
    for name, (model, _, timeout, idle, _) in ACCOUNTS.items():
        blocks.append(
            f"""
[llm_clients.{name}]
base_url = "{mock_url}"
api_key_env = "KEY_{name.upper()}"
auth = "x-api-key"
models = ["{model}"]
timeout_secs = {timeout}
stream_idle_secs = {idle}
failure_threshold = 100000
"""
        )
    return "".join(blocks)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    provider = MockProvider()
    for _, key, _, _, behaviour in ACCOUNTS.values():
        provider.set_behaviour(key, behaviour)
    env = {f"KEY_{name.upper()}": key for name, (_, key, *_) in ACCOUNTS.items()}
    with (
        serve_in_thread(provider) as mock_url,
        example_gateway(config(mock_url), tmp_path_factory.mktemp("gw"), env) as url,
    ):
        yield url


Outcome = tuple[int, str]
"""What the client saw: the HTTP status, and the error type (or "none")."""


def _error_type(body: object) -> str:
    """The error type of an error body or event, in either wire's shape."""
    error = body.get("error", body) if isinstance(body, dict) else None
    kind = error.get("type") if isinstance(error, dict) else None
    return kind if isinstance(kind, str) else repr(body)


async def _outcome(call: Callable[[], Awaitable[object]]) -> Outcome:
    try:
        await call()
    except anthropic.APIStatusError as exc:
        return exc.status_code, _error_type(exc.body)  # an error event keeps the stream's 200
    except openai.APIStatusError as exc:
        return exc.status_code, _error_type(exc.body)
    except openai.APIError as exc:  # an error event inside a started stream
        return 200, _error_type(exc.body)
    return 200, "none"


def _anthropic(gateway: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=gateway, api_key="caller", max_retries=0, timeout=30)


def _openai(gateway: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key="caller", max_retries=0, timeout=30)


def _anthropic_call(
    client: anthropic.AsyncAnthropic,
    model: str,
    *,
    stream: bool,
    headers: dict[str, str] | None = None,
) -> Callable[[], Awaitable[str]]:
    async def call() -> str:
        messages: Any = [{"role": "user", "content": "hi"}]
        # max_tokens 8: a non-streaming attempt's deadline stays `timeout_secs` (the floor).
        if not stream:
            await client.messages.create(
                model=model, max_tokens=8, messages=messages, extra_headers=headers
            )
            return ""
        text = ""
        events = await client.messages.create(
            model=model, max_tokens=8, messages=messages, stream=True, extra_headers=headers
        )
        async for event in events:
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                text += event.delta.text
        return text

    return call


def _openai_stream(client: openai.AsyncOpenAI, model: str) -> Callable[[], Awaitable[str]]:
    async def call() -> str:
        text = ""
        chunks = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], stream=True
        )
        async for chunk in chunks:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
        return text

    return call


def _counts(gateway: str, account: str, phase: str) -> dict[str, float]:
    """The counters a deadline moves, for one account and phase, and in all (one scrape)."""
    samples = [
        (series, float(value))
        for series, _, value in (
            line.rpartition(" ") for line in httpx.get(f"{gateway}/metrics").text.splitlines()
        )
        if series.startswith(("switchyard_account_faults_total{", "switchyard_deadline_exceeded"))
    ]

    def total(name: str, *labels: str) -> float:
        return sum(
            value
            for series, value in samples
            if series.startswith(name + "{") and all(label in series for label in labels)
        )

    faults, exceeded = "switchyard_account_faults_total", "switchyard_deadline_exceeded_total"
    return {
        "faults": total(faults, f'switchyard_account="{account}"'),
        "faults_deadline": total(faults, f'switchyard_account="{account}"', 'status="deadline"'),
        "exceeded": total(exceeded),
        "exceeded_phase": total(exceeded, f'phase="{phase}"'),
    }


def _after(before: dict[str, float], **added: float) -> dict[str, float]:
    return {name: value + added.get(name, 0.0) for name, value in before.items()}


def _settled(read: Callable[[], dict[str, float]], expected: dict[str, float]) -> dict[str, float]:
    """The counters once they reach `expected`, or as they are after a few seconds.

    A stream's fault is counted when its attempt ends, which may be just after the client
    read the stream's end; waiting for it here is not timing what is measured.
    """
    end = time.monotonic() + 10
    seen = read()
    while seen != expected and time.monotonic() < end:
        time.sleep(0.05)
        seen = read()
    return seen


async def _fire(call: Callable[[], Awaitable[object]]) -> list[Outcome]:
    """ROUNDS rounds one after the other, AT_ONCE concurrent calls in each."""
    outcomes: list[Outcome] = []
    for _ in range(ROUNDS):
        outcomes += await asyncio.gather(*(_outcome(call) for _ in range(AT_ONCE)))
    return outcomes


# phase -> (account, wire, stream?, budget header?, status the client gets)
PHASES: dict[str, tuple[str, str, bool, bool, int]] = {
    "total": ("late", "anthropic", False, False, 504),
    "headers": ("late", "anthropic", True, False, 504),
    "idle": ("silent", "anthropic", True, False, 200),
    "idle-openai": ("silent", "openai", True, False, 200),
    "budget": ("roomy", "anthropic", False, True, 504),
}


@pytest.mark.parametrize("case", list(PHASES))
async def test_each_deadline_phase_ends_the_same_way_every_time(gateway: str, case: str) -> None:
    account, wire, stream, budget, status = PHASES[case]
    phase = case.split("-")[0]
    model = ACCOUNTS[account][0]
    headers = {"x-switchyard-timeout-ms": str(int(BOUND_SECS * 1000))} if budget else None
    fired = ROUNDS * AT_ONCE
    before = _counts(gateway, account, phase)

    if wire == "openai":
        async with _openai(gateway) as gpt:
            outcomes = await _fire(_openai_stream(gpt, model))
    else:
        async with _anthropic(gateway) as claude:
            outcomes = await _fire(_anthropic_call(claude, model, stream=stream, headers=headers))

    assert outcomes == [(status, "deadline_exceeded")] * fired
    # The budget is the caller's: no account is at fault. Every other phase is the account's.
    account_faults = 0 if phase == "budget" else fired
    expected = _after(
        before,
        faults=account_faults,
        faults_deadline=account_faults,
        exceeded=fired,
        exceeded_phase=fired,
    )
    assert _settled(lambda: _counts(gateway, account, phase), expected) == expected


async def test_a_stream_pausing_longer_than_timeout_secs_runs_to_its_end(gateway: str) -> None:
    """`timeout_secs` bounds only the start: gaps under `stream_idle_secs` never cut a stream."""
    model = ACCOUNTS["patient"][0]
    before = _counts(gateway, "patient", "idle")
    async with _anthropic(gateway) as claude, _openai(gateway) as gpt:
        calls = [_anthropic_call(claude, model, stream=True), _openai_stream(gpt, model)]
        texts = await asyncio.gather(*(call() for call in calls))

    assert texts == ["one two three", "one two three"]
    assert _counts(gateway, "patient", "idle") == before
