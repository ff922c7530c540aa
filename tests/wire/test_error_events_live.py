"""Each wire's error answers, as the clients people use read them, through the example gateway.

A stream that started cannot change its status: switchyard ends it with one error event in the
wire's own format. Each wire's event (and its error body before a stream started) is checked
against its official SDK and the Vercel AI SDK (`@ai-sdk/anthropic`, `@ai-sdk/openai` in Chat and
Responses mode, under Node): each must report the gateway's error type and message, not a
parse error of its own. The gateway runs under uvicorn in front of the mock provider, which
misbehaves per account key: `cut` drops the connection after the first text delta (the
forwarder ends the stream with `upstream_error`), `silent` stalls after it (the deadline policy
ends it with `deadline_exceeded`, phase `idle`), `late` does not answer within `timeout_secs`
(504 before anything started).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, NamedTuple

import anthropic
import httpx
import openai
import pytest
from openai.types.responses import ResponseErrorEvent, ResponseTextDeltaEvent

from node_clients import AiSdk, Call
from servers import example_gateway, serve_in_thread
from switchyard_mw.engine.answers import deadline_exceeded
from switchyard_mw.testing import Behaviour, MockProvider

pytestmark = pytest.mark.integration

BOUND_SECS = 0.3
SILENCE_SECS = 5.0
WIRES = ("anthropic", "chat", "responses")
PATHS = {"anthropic": "/v1/messages", "chat": "/v1/chat/completions", "responses": "/v1/responses"}

# account name -> (model, timeout_secs, stream_idle_secs, how the mock answers its key)
ACCOUNTS: dict[str, tuple[str, float, float, Behaviour]] = {
    "cut": (
        "m-cut",
        30.0,
        30.0,
        Behaviour(chunks=3, stall_after_chunks=1, fail="reset_mid_stream"),
    ),
    "silent": (
        "m-silent",
        30.0,
        BOUND_SECS,
        Behaviour(chunks=3, stall_after_chunks=1, body_stall_secs=SILENCE_SECS),
    ),
    "late": ("m-late", BOUND_SECS, BOUND_SECS, Behaviour(headers_delay_secs=SILENCE_SECS)),
}
STREAM_CASES = {"cut": "upstream_error", "idle": "deadline_exceeded"}
"""A stream broken after it started -> the error type its event carries."""
ACCOUNT_OF = {"cut": "cut", "idle": "silent"}


def _config(mock_url: str) -> str:
    return "".join(
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
        for name, (model, timeout, idle, _) in ACCOUNTS.items()
    )


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    provider = MockProvider()
    for name, (*_, behaviour) in ACCOUNTS.items():
        provider.set_behaviour(f"key-{name}", behaviour)
    env = {f"KEY_{name.upper()}": f"key-{name}" for name in ACCOUNTS}
    with (
        serve_in_thread(provider) as mock_url,
        example_gateway(_config(mock_url), tmp_path_factory.mktemp("gw"), env) as url,
    ):
        yield url


AI_SDK_CALLS = [
    *(Call(wire, ACCOUNTS[ACCOUNT_OF[case]][0], True) for wire in WIRES for case in STREAM_CASES),
    *(Call(wire, ACCOUNTS["late"][0], False) for wire in WIRES),
]


@pytest.fixture(scope="module")
def ai_sdk(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[Call, dict[str, Any]]:
    """What the AI SDK reported for each of `AI_SDK_CALLS`: one Node process makes them all.
    Installed before the gateway starts: without Node, that is a skip (or failure) at once."""
    sdk = AiSdk(tmp_path_factory.mktemp("ai-sdk"))
    gateway: str = request.getfixturevalue("gateway")
    return dict(zip(AI_SDK_CALLS, sdk.calls(gateway, AI_SDK_CALLS), strict=True))


def _body(wire: str, model: str, *, stream: bool) -> dict[str, Any]:
    if wire == "responses":
        return {"model": model, "input": "hi", "max_output_tokens": 20, "stream": stream}
    return {
        "model": model,
        "max_tokens": 20,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": stream,
    }


class Event(NamedTuple):
    name: str | None
    data: dict[str, Any]


def _events(raw: str) -> list[Event]:
    events = []
    for block in raw.replace("\r\n", "\n").split("\n\n"):
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        if data and data != ["[DONE]"]:
            events.append(Event(name, json.loads("\n".join(data))))
    return events


def _raw_stream(gateway: str, wire: str, case: str) -> list[Event]:
    model = ACCOUNTS[ACCOUNT_OF[case]][0]
    r = httpx.post(f"{gateway}{PATHS[wire]}", json=_body(wire, model, stream=True), timeout=30)
    assert r.status_code == 200
    return _events(r.text)


class Reported(NamedTuple):
    """What a client said went wrong: the error type (Responses: its `code`) and message."""

    kind: str
    message: str


def _expected(gateway: str, wire: str, case: str) -> Reported:
    """The error the gateway ends this case's stream with, as its own terms say."""
    if case == "idle":
        error = deadline_exceeded("idle")
        return Reported(error.error_type, error.message)
    # A cut's message names the transport error; read it off the wire, its type is fixed.
    last = _raw_stream(gateway, wire, case)[-1].data
    error = last if wire == "responses" else last["error"]
    kind = error["code"] if wire == "responses" else error["type"]
    assert kind == "upstream_error"
    assert error["message"].startswith("upstream stream failed: ")
    return Reported(kind, error["message"])


@pytest.mark.parametrize("case", list(STREAM_CASES))
@pytest.mark.parametrize("wire", WIRES)
def test_a_broken_stream_ends_with_the_wires_own_error_event(
    gateway: str, wire: str, case: str
) -> None:
    events = _raw_stream(gateway, wire, case)
    last = events[-1]
    kind = STREAM_CASES[case]
    if wire == "anthropic":
        assert last.name == "error"
        assert last.data["type"] == "error"
        assert last.data["error"]["type"] == kind
    elif wire == "chat":
        assert last.name is None
        assert last.data["error"]["type"] == last.data["error"]["code"] == kind
    else:
        assert last.name == "error"
        assert set(last.data) == {"type", "code", "message", "param", "sequence_number"}
        event = ResponseErrorEvent.model_validate(last.data)
        assert (event.type, event.code, event.param) == ("error", kind, None)
        # Every Responses event carries a sequence number; the error follows the last one sent.
        numbers = [e.data["sequence_number"] for e in events]
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
    assert len(events) > 2  # the stream had started: the error came after its first events


async def _official_stream(gateway: str, wire: str, model: str) -> tuple[Reported, str]:
    """The error the official SDK raised (Responses: the typed error event it yielded), and
    the text received before it."""
    text = ""
    body = _body(wire, model, stream=True)
    if wire == "anthropic":
        async with anthropic.AsyncAnthropic(base_url=gateway, api_key="k", max_retries=0) as claude:
            try:
                async for event in await claude.messages.create(**body):
                    if event.type == "content_block_delta" and event.delta.type == "text_delta":
                        text += event.delta.text
            except anthropic.APIStatusError as exc:
                error = exc.body["error"]  # type: ignore[index]
                return Reported(error["type"], error["message"]), text
        raise AssertionError("the stream ended without an error")
    async with openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key="k", max_retries=0) as gpt:
        if wire == "chat":
            try:
                async for chunk in await gpt.chat.completions.create(**body):
                    text += chunk.choices[0].delta.content or "" if chunk.choices else ""
            except openai.APIError as exc:
                return Reported(f"{exc.code}/{exc.type}", exc.message), text
            raise AssertionError("the stream ended without an error")
        seen: list[int] = []
        async for event in await gpt.responses.create(**body):
            seen.append(event.sequence_number)
            if isinstance(event, ResponseTextDeltaEvent):
                text += event.delta
            last = event
        assert isinstance(last, ResponseErrorEvent), last
        assert seen == list(range(seen[0], seen[0] + len(seen)))
        return Reported(str(last.code), last.message), text


@pytest.mark.parametrize("case", list(STREAM_CASES))
@pytest.mark.parametrize("wire", WIRES)
async def test_the_official_sdk_reports_the_gateways_error_in_a_started_stream(
    gateway: str, wire: str, case: str
) -> None:
    expected = _expected(gateway, wire, case)
    if wire == "chat":  # the SDK's error has both the type and the code: the same here
        expected = expected._replace(kind=f"{expected.kind}/{expected.kind}")
    reported, text = await _official_stream(gateway, wire, ACCOUNTS[ACCOUNT_OF[case]][0])
    assert text  # the stream had started
    assert reported == expected


def _ai_sdk_error(wire: str, error: dict[str, Any]) -> Reported:
    """The type and message of an error part of the AI SDK's stream.

    Anthropic's part is the event's `error` object (`type`, `message`); Chat's the chunk's
    `error` object (`type`, `code`, `message`); Responses' the SDK's own stream error, which
    keeps the event's `code` and `message` and the event itself as `data`.
    """
    if wire == "responses":
        assert error.get("data", {}).get("type") == "error", error
        return Reported(error["code"], error["message"])
    return Reported(error["type"], error["message"])


@pytest.mark.timeout(300)  # the first test also installs the packages
@pytest.mark.parametrize("case", list(STREAM_CASES))
@pytest.mark.parametrize("wire", WIRES)
def test_the_ai_sdk_reports_the_gateways_error_in_a_started_stream(
    ai_sdk: dict[Call, dict[str, Any]], gateway: str, wire: str, case: str
) -> None:
    expected = _expected(gateway, wire, case)
    outcome = ai_sdk[Call(wire, ACCOUNTS[ACCOUNT_OF[case]][0], True)]
    assert outcome["text"]  # the stream had started
    assert [_ai_sdk_error(wire, e) for e in outcome["errors"]] == [expected], outcome


# --- before the stream started: the error body -----------------------------------------------

LATE = deadline_exceeded("total")


async def _official_whole(gateway: str, wire: str) -> tuple[int, Reported]:
    body = _body(wire, ACCOUNTS["late"][0], stream=False)
    if wire == "anthropic":
        async with anthropic.AsyncAnthropic(base_url=gateway, api_key="k", max_retries=0) as claude:
            with pytest.raises(anthropic.APIStatusError) as raised:
                await claude.messages.create(**body)
            error = raised.value.body["error"]  # type: ignore[index]
            return raised.value.status_code, Reported(error["type"], error["message"])
    async with openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key="k", max_retries=0) as gpt:
        call = gpt.chat.completions.create if wire == "chat" else gpt.responses.create
        with pytest.raises(openai.APIStatusError) as failed:
            await call(**body)
        exc = failed.value
        assert exc.code == exc.type
        error = exc.body  # the SDK's own `message` is prefixed with the status
        assert isinstance(error, dict)
        return exc.status_code, Reported(str(exc.type), error["message"])


@pytest.mark.parametrize("wire", WIRES)
async def test_the_official_sdk_reports_the_gateways_error_answer(gateway: str, wire: str) -> None:
    assert await _official_whole(gateway, wire) == (
        LATE.status,
        Reported(LATE.error_type, LATE.message),
    )


@pytest.mark.parametrize("wire", WIRES)
def test_the_ai_sdk_reports_the_gateways_error_answer(
    ai_sdk: dict[Call, dict[str, Any]], wire: str
) -> None:
    outcome = ai_sdk[Call(wire, ACCOUNTS["late"][0], False)]
    [error] = outcome["errors"]
    assert error["name"] == "AI_APICallError"
    assert error["statusCode"] == LATE.status
    assert (error["data"]["error"]["type"], error["message"]) == (LATE.error_type, LATE.message)
