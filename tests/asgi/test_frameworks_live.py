"""The framework matrix, through real servers: what a client gets through each framework.

Targets: a small user gateway on each of Starlette, FastAPI, Litestar and Django (ASGI) wrapped
by `switchyard_stack`, served by uvicorn (`framework_apps.py`); and the example gateway under
uvicorn, hypercorn and granian, each in a subprocess as a user runs it. Upstream: the bundled
mock provider, on a thread of this process. Each target's server starts once per module.

Each case has its own model, so the accounts of one case never answer another's:

| model     | accounts (priority order)                         |
|-----------|---------------------------------------------------|
| m-ok      | ok                                                |
| m-401     | rejecting (the mock answers its key 401), ok      |
| m-refused | closed (nothing listens on its port), ok          |
| m-down    | down-1, down-2 (both closed ports)                |
| m-alone-down | alone-down (a closed port)                     |
| m-slow    | slow (the mock waits 3 s; timeout_secs 1)         |
| m-stream  | streamer (1.5 s between chunks; timeout_secs 1, stream_idle_secs 4) |
| m-cut     | cutter (the mock resets the connection after the first text delta) |

On a deadline the app's own upstream call must end too, not only the client's answer: the
mock counts the requests it is still answering (`in_flight`), and a call the app dropped ends
there as soon as its connection closes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import httpx
import msgspec
import openai
import pytest
import uvicorn

import framework_apps
from node_clients import AiSdk, Call
from servers import ROOT, free_port, refusing_port, serve_in_thread, wait_for_port
from switchyard_mw.testing import Behaviour, MockProvider

pytestmark = pytest.mark.integration

FRAMEWORKS = framework_apps.FRAMEWORKS
EXAMPLE_SERVERS = ("uvicorn", "hypercorn", "granian")
TARGETS = (*FRAMEWORKS, *(f"example-{server}" for server in EXAMPLE_SERVERS))
KEYS = {
    "KEY_OK": "ok-key",
    "KEY_REJECTING": "rejecting-key",
    "KEY_SLOW": "slow-key",
    "KEY_STREAM": "stream-key",
    "KEY_CUT": "cut-key",
    "KEY_JUDGE": "judge-key",
    "KEY_CLOSED": "closed-key",
}
STREAM_CHUNKS = 3
MESSAGES: Any = [{"role": "user", "content": "Say hello"}]
REFUSED = "timeout_secs = 10\n"
"""The refusing accounts' deadline: a refusal takes a millisecond, and should a connection hang
instead, the case fails with a 504 well inside pytest's timeout rather than by it."""
FAILED_ATTEMPT = "attempt failed"  # the one record per failed attempt (switchyard_mw.accounts)


@pytest.fixture(scope="module")
def refused() -> Iterator[list[str]]:
    """Four loopback URLs that refuse connections for the whole module (`refusing_port`)."""
    with contextlib.ExitStack() as stack:
        ports = [stack.enter_context(refusing_port()) for _ in range(4)]
        yield [f"http://127.0.0.1:{port}" for port in ports]


def _config(mock_url: str, closed: list[str]) -> str:
    accounts = [
        ("ok", mock_url, "KEY_OK", ["m-ok", "m-401", "m-refused", "m-judged", "m-canary-2"], 1, ""),
        ("rejecting", mock_url, "KEY_REJECTING", ["m-401"], 0, ""),
        ("closed", closed[0], "KEY_CLOSED", ["m-refused"], 0, REFUSED),
        ("down-1", closed[1], "KEY_CLOSED", ["m-down"], 0, REFUSED),
        ("down-2", closed[2], "KEY_CLOSED", ["m-down"], 1, REFUSED),
        ("alone-down", closed[3], "KEY_CLOSED", ["m-alone-down"], 0, REFUSED),
        ("slow", mock_url, "KEY_SLOW", ["m-slow"], 0, "timeout_secs = 1\n"),
        (
            "streamer",
            mock_url,
            "KEY_STREAM",
            ["m-stream"],
            0,
            "timeout_secs = 1\nstream_idle_secs = 4\n",
        ),
        ("judge", mock_url, "KEY_JUDGE", ["m-judge"], 0, ""),
        ("cutter", mock_url, "KEY_CUT", ["m-cut"], 0, ""),
    ]
    text = ""
    for name, url, key, models, priority, extra in accounts:
        text += (
            f'[llm_clients.{name}]\nbase_url = "{url}"\napi_key_env = "{key}"\n'
            f'auth = "x-api-key"\nmodels = {models!r}\npriority = {priority}\n'
            f"failure_threshold = 1000\n{extra}\n"
        ).replace("'", '"')
    return (
        text
        + """
[canaries."m-ok"]
variants = { "m-canary-2" = 100.0 }

[routes.auto]
classifier = "llm"
judge = "judge"
judge_model = "m-judge"
judge_deadline_ms = 2000
choices = { simple = "m-ok", complex = "m-judged" }
fallback = "m-ok"
"""
    )


def _canary_free(text: str) -> str:
    """The config without its canary: the stack cases ask for `m-ok` and must get it."""
    return text.replace('[canaries."m-ok"]\nvariants = { "m-canary-2" = 100.0 }\n', "")


@pytest.fixture(scope="module")
def mock() -> Iterator[tuple[MockProvider, str]]:
    provider = MockProvider()
    _script(provider)
    with serve_in_thread(provider) as url:
        yield provider, url


def _script(provider: MockProvider) -> None:
    provider.set_behaviour(KEYS["KEY_REJECTING"], Behaviour(status=401))
    provider.set_behaviour(KEYS["KEY_SLOW"], Behaviour(headers_delay_secs=3.0))
    provider.set_behaviour(
        KEYS["KEY_STREAM"], Behaviour(chunks=STREAM_CHUNKS, chunk_interval_secs=1.5)
    )
    provider.set_behaviour(KEYS["KEY_JUDGE"], Behaviour(reply="complex"))
    provider.set_behaviour(
        KEYS["KEY_CUT"], Behaviour(chunks=3, stall_after_chunks=1, fail="reset_mid_stream")
    )


@pytest.fixture(autouse=True)
def rescript(mock: tuple[MockProvider, str]) -> Iterator[None]:
    yield
    mock[0].reset()
    _script(mock[0])


@pytest.fixture(scope="module")
def keys() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        for name, value in KEYS.items():
            patch.setenv(name, value)
        yield


@pytest.fixture(scope="module")
def config_file(
    mock: tuple[MockProvider, str], refused: list[str], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    path = tmp_path_factory.mktemp("matrix") / "switchyard.toml"
    path.write_text(_config(mock[1], refused))
    return path


# --- servers -------------------------------------------------------------------------------


class _Lines(logging.Handler):
    """Every log record of this process, formatted with its traceback, as a server log has."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if record.name == "django.request":
            # Django logs every exception its views raise, whoever catches it later; silent
            # under Django's default logging (DEBUG off), and not the server's log.
            return
        self.lines.append(self.format(record))


@dataclass
class Target:
    """A served gateway: its URL and what its server logged."""

    name: str
    url: str
    _log: Any = None
    events: list[str] = field(default_factory=list)

    def log(self) -> str:
        if isinstance(self._log, _Lines):
            return "\n".join(self._log.lines)
        return Path(self._log).read_text(errors="replace")

    def log_mark(self) -> int:
        return len(self.log())


@contextlib.contextmanager
def uvicorn_thread(app: Any) -> Iterator[str]:
    """`app` under uvicorn on a thread, with its lifespan, logging to this process's loggers
    (no logging config of uvicorn's own, so its error log reaches our handler)."""
    port = free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, lifespan="on", log_config=None, access_log=False
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for_port(port)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def _example_command(server: str, port: int) -> list[str]:
    app = "examples.starlette_app:app"
    if server == "uvicorn":
        return [sys.executable, "-m", "uvicorn", app, "--port", str(port), "--log-level", "warning"]
    if server == "hypercorn":
        return [sys.executable, "-m", "hypercorn", app, "--bind", f"127.0.0.1:{port}"]
    granian = str(Path(sys.executable).with_name("granian"))
    return [granian, "--interface", "asgi", "--port", str(port), "--log-level", "warning", app]


@contextlib.contextmanager
def example_under(server: str, config: Path, log: Path) -> Iterator[str]:
    """The example gateway under `server` in a subprocess, as its README runs it."""
    port = free_port()
    env = {**os.environ, "SWITCHYARD_CONFIG": str(config), "SWITCHYARD_START_MOCK": "0"}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            _example_command(server, port), cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
        )
        try:
            try:
                wait_for_port(port, timeout=30)
            except TimeoutError:
                proc.kill()
                raise RuntimeError(log.read_text()) from None
            yield f"http://127.0.0.1:{port}"
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module", params=TARGETS)
def target(
    request: pytest.FixtureRequest,
    mock: tuple[MockProvider, str],
    refused: list[str],
    keys: None,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Target]:
    name: str = request.param
    workdir = tmp_path_factory.mktemp(name)
    config = workdir / "switchyard.toml"
    config.write_text(_canary_free(_config(mock[1], refused)))
    if name.startswith("example-"):
        log = workdir / "server.log"
        with example_under(name.removeprefix("example-"), config, log) as url:
            yield Target(name, url, log)
        return
    events: list[str] = []
    app = framework_apps.build(
        name, "stack", config=config, default_upstream=mock[1], events=events
    )
    lines = _Lines()
    logging.getLogger().addHandler(lines)
    try:
        with uvicorn_thread(app) as url:
            yield Target(name, url, lines, events)
    finally:
        logging.getLogger().removeHandler(lines)


def _anthropic(target: Target) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=target.url, api_key="caller-key", max_retries=0)


def _openai(target: Target) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{target.url}/v1", api_key="caller-key", max_retries=0)


# --- the rows every target passes ----------------------------------------------------------


def test_ok_200_with_the_switchyard_headers(target: Target) -> None:
    raw = _anthropic(target).messages.with_raw_response.create(
        model="m-ok", max_tokens=32, messages=MESSAGES
    )
    message = raw.parse()
    assert message.model == "m-ok"
    assert message.content[0].type == "text"
    assert message.content[0].text
    assert raw.headers["x-switchyard-account"] == "ok"
    assert raw.headers["x-switchyard-model"] == "m-ok"
    assert raw.headers["x-switchyard-attempts"] == "1"
    chat = _openai(target).chat.completions.with_raw_response.create(
        model="m-ok", messages=MESSAGES
    )
    assert chat.parse().choices[0].message.content
    assert chat.headers["x-switchyard-account"] == "ok"


def test_401_fails_over(target: Target, mock: tuple[MockProvider, str]) -> None:
    raw = _anthropic(target).messages.with_raw_response.create(
        model="m-401", max_tokens=32, messages=MESSAGES
    )
    assert raw.parse().content[0].type == "text"
    assert raw.headers["x-switchyard-account"] == "ok"
    assert raw.headers["x-switchyard-attempts"] == "2"
    assert [r.key for r in mock[0].requests] == [KEYS["KEY_REJECTING"], KEYS["KEY_OK"]]


def test_refused_connection_fails_over(target: Target) -> None:
    mark = target.log_mark()
    raw = _openai(target).chat.completions.with_raw_response.create(
        model="m-refused", messages=MESSAGES
    )
    assert raw.parse().choices[0].message.content
    assert raw.headers["x-switchyard-account"] == "ok"
    assert raw.headers["x-switchyard-attempts"] == "2"
    log = target.log()[mark:]
    assert "Traceback" not in log
    assert log.count(FAILED_ATTEMPT) == 1


def test_every_account_unreachable_is_502_upstream_unreachable(target: Target) -> None:
    mark = target.log_mark()
    with pytest.raises(anthropic.APIStatusError) as anthropic_error:
        _anthropic(target).messages.create(model="m-down", max_tokens=32, messages=MESSAGES)
    with pytest.raises(openai.APIStatusError) as openai_error:
        _openai(target).chat.completions.create(model="m-down", messages=MESSAGES)
    for error in (anthropic_error.value, openai_error.value):
        assert error.status_code == 502
        assert error.response.headers["content-type"] == "application/json"
        assert error.response.headers["x-switchyard-attempts"] == "2"
    assert anthropic_error.value.response.json()["error"]["type"] == "upstream_unreachable"
    assert openai_error.value.response.json()["error"]["code"] == "upstream_unreachable"
    with pytest.raises(anthropic.APIStatusError) as one_account:
        _anthropic(target).messages.create(model="m-alone-down", max_tokens=32, messages=MESSAGES)
    assert one_account.value.status_code == 502
    assert one_account.value.response.headers["x-switchyard-attempts"] == "1"
    assert one_account.value.response.json()["error"]["type"] == "upstream_unreachable"
    log = target.log()[mark:]
    assert "Traceback" not in log
    assert log.count(FAILED_ATTEMPT) == 5  # two requests of two attempts, one of one


def test_slow_upstream_is_504_deadline_exceeded(target: Target) -> None:
    with pytest.raises(anthropic.APIStatusError) as error:
        _anthropic(target).messages.create(model="m-slow", max_tokens=16, messages=MESSAGES)
    assert error.value.status_code == 504
    assert error.value.response.json()["error"]["type"] == "deadline_exceeded"
    assert error.value.response.headers["x-switchyard-account"] == "slow"


SLOW_SECS = 8.0
"""How long the mock stalls in the cancellation rows: an app whose call ran on would still be
in flight 7 s after the 504, far beyond the 1 s allowed."""
DROPPED_WITHIN_SECS = 0.5
"""Well under the 1 s past the deadline at which `timeout_for`'s own bound would end the call
anyway (BACKSTOP_SECS): a dropped call ends within a few hundredths of a second."""


def _dropped_after(mock: MockProvider, answered: float) -> float:
    """Seconds from `answered` until the mock was answering no request (at most SLOW_SECS)."""
    while mock.in_flight and time.monotonic() < answered + SLOW_SECS:
        time.sleep(0.02)
    return time.monotonic() - answered


def _idle(mock: MockProvider) -> None:
    """Wait for calls still running from an earlier row (an app that did not drop its own)."""
    end = time.monotonic() + SLOW_SECS
    while mock.in_flight and time.monotonic() < end:
        time.sleep(0.05)


def test_a_deadline_drops_the_apps_upstream_call(
    target: Target, mock: tuple[MockProvider, str]
) -> None:
    """Before the response started: a 504 at the deadline (1 s), and the call the app was
    waiting on is dropped with it."""
    _idle(mock[0])
    mock[0].set_behaviour(KEYS["KEY_SLOW"], Behaviour(headers_delay_secs=SLOW_SECS))
    sent = time.monotonic()
    with pytest.raises(anthropic.APIStatusError) as error:
        _anthropic(target).messages.create(model="m-slow", max_tokens=16, messages=MESSAGES)
    answered = time.monotonic()
    assert error.value.status_code == 504
    assert error.value.response.json()["error"]["type"] == "deadline_exceeded"
    assert 0.9 <= answered - sent < SLOW_SECS / 2  # the deadline answered, not the upstream
    assert len([r for r in mock[0].requests if r.key == KEYS["KEY_SLOW"]]) == 1
    assert _dropped_after(mock[0], answered) <= DROPPED_WITHIN_SECS


def test_an_idle_stream_drops_the_apps_upstream_call(
    target: Target, mock: tuple[MockProvider, str]
) -> None:
    """After the response started: one delta, then the upstream goes quiet past
    stream_idle_secs (4); the client gets the wire's error event, and the app's call (which
    it was relaying) is dropped with it."""
    _idle(mock[0])
    mock[0].set_behaviour(
        KEYS["KEY_STREAM"], Behaviour(chunks=3, stall_after_chunks=1, body_stall_secs=SLOW_SECS)
    )
    with (
        pytest.raises(anthropic.APIStatusError) as error,
        _anthropic(target).messages.stream(
            model="m-stream", max_tokens=32, messages=MESSAGES
        ) as stream,
    ):
        for _ in stream.text_stream:
            pass
    answered = time.monotonic()
    body: Any = error.value.body
    assert (error.value.status_code, body["error"]["type"]) == (200, "deadline_exceeded")
    assert _dropped_after(mock[0], answered) <= DROPPED_WITHIN_SECS


def test_a_client_that_leaves_drops_the_apps_upstream_call(
    target: Target, mock: tuple[MockProvider, str]
) -> None:
    """The client gives up after 0.5 s (its own read timeout) on an upstream that stalls; the
    app's call is dropped as soon as the stack notices (within WATCH_AFTER_SECS and a sweep)."""
    _idle(mock[0])
    mock[0].set_behaviour(KEYS["KEY_OK"], Behaviour(headers_delay_secs=SLOW_SECS))
    payload = {"model": "m-ok", "max_tokens": 16, "messages": MESSAGES}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{target.url}/v1/messages", json=payload, timeout=httpx.Timeout(5, read=0.5))
    left = time.monotonic()
    assert len([r for r in mock[0].requests if r.key == KEYS["KEY_OK"]]) == 1
    assert _dropped_after(mock[0], left) <= DROPPED_WITHIN_SECS


def test_a_sync_django_view_does_not_hold_the_504(
    target: Target, mock: tuple[MockProvider, str]
) -> None:
    """A sync view runs in a thread, which nothing can stop: its call runs on (see
    docs/policies/deadline.md). The client's 504 must not wait for it: Django's handler
    waits for the view's thread as the request ends, and the deadline cancels that wait."""
    if target.name != "django":
        pytest.skip("a Django view")
    _idle(mock[0])
    mock[0].set_behaviour(KEYS["KEY_SLOW"], Behaviour(headers_delay_secs=SLOW_SECS))
    payload = {"model": "m-slow", "input": "hi", "max_output_tokens": 16}
    sent = time.monotonic()
    answer = httpx.post(
        f"{target.url}{framework_apps.SYNC_VIEW_PATH}", json=payload, timeout=SLOW_SECS * 2
    )
    answered = time.monotonic()
    assert answer.status_code == 504
    assert answer.json()["error"]["code"] == "deadline_exceeded"
    # The deadline (1 s), then the view's listener is told and the task cancelled at most
    # four times 0.25 s apart: about 2 s at most, far from the 8 s the view's call takes.
    assert 0.9 <= answered - sent < SLOW_SECS / 2
    assert mock[0].in_flight == 1  # the view's own call, in its thread, runs on


def test_stream_with_gaps_under_the_idle_limit_completes(target: Target) -> None:
    """1.5 s between chunks: longer than timeout_secs (1), shorter than stream_idle_secs (4)."""
    with _anthropic(target).messages.stream(
        model="m-stream", max_tokens=32, messages=MESSAGES
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "Hello from the mock provider."
    assert final.stop_reason == "end_turn"


@pytest.fixture(scope="module")
def ai_sdk(tmp_path_factory: pytest.TempPathFactory) -> AiSdk:
    """The Vercel AI SDK under Node, installed once for the module."""
    return AiSdk(tmp_path_factory.mktemp("ai-sdk"))


BROKEN = "upstream stream failed: "
"""How the error event of a stream the upstream broke begins its message (then the
transport error's name)."""


def _read_text(events: Any, into: list[str], text_of: Any) -> None:
    """Append the text of each event of a stream, keeping what arrived before it raises."""
    for event in events:
        into.append(text_of(event))


def _broken_anthropic_stream(target: Target) -> tuple[str, dict[str, Any]]:
    text: list[str] = []
    with (
        _anthropic(target).messages.stream(
            model="m-cut", max_tokens=32, messages=MESSAGES
        ) as stream,
        pytest.raises(anthropic.APIStatusError) as error,
    ):
        _read_text(stream.text_stream, text, str)
    assert error.value.status_code == 200  # the stream had started: its status stands
    body: Any = error.value.body
    return "".join(text), body["error"]


def _broken_chat_stream(target: Target) -> tuple[str, openai.APIError]:
    text: list[str] = []
    chunks = _openai(target).chat.completions.create(model="m-cut", messages=MESSAGES, stream=True)
    with pytest.raises(openai.APIError) as error:
        _read_text(chunks, text, lambda c: c.choices[0].delta.content or "" if c.choices else "")
    return "".join(text), error.value


@pytest.mark.timeout(300)  # the first target also installs the AI SDK's packages
def test_a_stream_the_upstream_breaks_ends_with_the_wires_error_event(
    target: Target, ai_sdk: AiSdk
) -> None:
    """The mock resets the connection after the first text delta: the app's relay
    (`relay_stream`; the example's forwarder) ends the client's stream with the wire's error
    event, which each client reports as the gateway's error after the text it had, and the
    server logs no traceback."""
    mark = target.log_mark()
    text, claude_error = _broken_anthropic_stream(target)
    assert text == "Hello fro"
    assert claude_error["type"] == "upstream_error"
    assert claude_error["message"].startswith(BROKEN)
    text, chat_error = _broken_chat_stream(target)
    assert text == "Hello fro"
    assert (chat_error.type, chat_error.code) == ("upstream_error", "upstream_error")
    assert chat_error.message.startswith(BROKEN)
    calls = [Call("anthropic", "m-cut", True), Call("chat", "m-cut", True)]
    for outcome in ai_sdk.calls(target.url, calls):
        assert outcome["text"] == "Hello fro", outcome
        [error] = outcome["errors"]  # one error part, the gateway's: no "terminated"
        assert error["type"] == "upstream_error", outcome
        assert error["message"].startswith(BROKEN), outcome
    assert "Traceback" not in target.log()[mark:]


# --- the rows of the framework apps (the example has no websocket of its own) --------------


@pytest.fixture(params=FRAMEWORKS)
def framework(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


def test_lifespan_startup_and_shutdown_still_run(
    framework: str, config_file: Path, mock: tuple[MockProvider, str], keys: None
) -> None:
    events: list[str] = []
    app = framework_apps.build(
        framework, "stack", config=config_file, default_upstream=mock[1], events=events
    )
    with uvicorn_thread(app) as url:
        assert events == ["startup"]
        assert httpx.get(f"{url}/hello").status_code == 200
    assert events == ["startup", "shutdown"]


def test_websocket_and_non_llm_routes_pass_untouched(target: Target) -> None:
    if target.name.startswith("example-"):
        pytest.skip("the example gateway has no websocket or plain route of its own")
    hello = httpx.get(f"{target.url}/hello")
    assert (hello.status_code, hello.text) == (200, f"hello from {target.name}")
    assert not [h for h in hello.headers if h.startswith("x-switchyard")]
    body = b'{"model": "m-ok", "note": "not an LLM call"}'
    echo = httpx.post(f"{target.url}/echo", content=body)
    assert (echo.status_code, echo.content) == (200, body)
    assert not [h for h in echo.headers if h.startswith("x-switchyard")]
    assert _websocket_echo(target.url, "ping") == "echo:ping"


def _websocket_echo(url: str, text: str) -> str:
    """One text message over a websocket to `/ws`, and the answer (aiohttp's client)."""
    import asyncio

    import aiohttp

    async def talk() -> str:
        async with aiohttp.ClientSession() as session, session.ws_connect(f"{url}/ws") as ws:
            await ws.send_str(text)
            message = await ws.receive(timeout=10)
            return str(message.data)

    return asyncio.run(talk())


# --- each middleware alone, added the framework's own way ----------------------------------


@pytest.fixture(scope="module")
def alone(
    config_file: Path, mock: tuple[MockProvider, str], keys: None
) -> Iterator[dict[tuple[str, str], str]]:
    """One server per (framework, middleware), started when a test first asks for it."""
    with contextlib.ExitStack() as stack:

        class Lazy(dict[tuple[str, str], str]):
            def __missing__(self, key: tuple[str, str]) -> str:
                app = framework_apps.build(
                    key[0], key[1], config=config_file, default_upstream=mock[1], events=[]
                )
                url = self[key] = stack.enter_context(uvicorn_thread(app))
                return url

        yield Lazy()


def test_cooling_alone_fails_over(
    framework: str, alone: dict[tuple[str, str], str], mock: tuple[MockProvider, str]
) -> None:
    url = alone[framework, "cooling"]
    raw = _anthropic(Target("", url)).messages.with_raw_response.create(
        model="m-401", max_tokens=32, messages=MESSAGES
    )
    assert raw.parse().model == "m-401"
    assert raw.headers["x-switchyard-account"] == "ok"
    assert raw.headers["x-switchyard-attempts"] == "2"
    with pytest.raises(anthropic.APIStatusError) as error:
        _anthropic(Target("", url)).messages.create(
            model="m-down", max_tokens=32, messages=MESSAGES
        )
    assert error.value.status_code == 502
    assert error.value.response.json()["error"]["type"] == "upstream_unreachable"


def test_judge_alone_routes(
    framework: str, alone: dict[tuple[str, str], str], mock: tuple[MockProvider, str]
) -> None:
    url = alone[framework, "judge"]
    raw = _anthropic(Target("", url)).messages.with_raw_response.create(
        model="auto", max_tokens=32, messages=MESSAGES
    )
    assert raw.parse().model == "m-judged"  # the mock echoes the model it was asked for
    assert raw.headers["x-switchyard-route"] == "judge:complex"
    judged = [r for r in mock[0].requests if r.key == framework_apps.DEFAULT_KEY]
    assert [r.model for r in judged] == ["m-judged"]


def test_variant_alone_moves_the_canary(
    framework: str, alone: dict[tuple[str, str], str], mock: tuple[MockProvider, str]
) -> None:
    url = alone[framework, "variant"]
    chat = _openai(Target("", url)).chat.completions.create(
        model="m-ok", messages=MESSAGES, user="someone"
    )
    assert chat.model == "m-canary-2"


def test_deadline_alone_answers_504(
    framework: str, alone: dict[tuple[str, str], str], mock: tuple[MockProvider, str]
) -> None:
    url = alone[framework, "deadline"]
    mock[0].set_behaviour(framework_apps.DEFAULT_KEY, Behaviour(headers_delay_secs=3.0))
    with pytest.raises(openai.APIStatusError) as error:
        _openai(Target("", url)).chat.completions.create(
            model="m-ok", messages=MESSAGES, max_completion_tokens=16
        )
    assert error.value.status_code == 504
    assert error.value.response.json()["error"]["code"] == "deadline_exceeded"


def _long_conversation() -> list[dict[str, Any]]:
    """About 60 KB past ASCII, blocks and strings: read by simdjson (`simd_read`), not msgspec."""
    turns: list[dict[str, Any]] = []
    for i in range(120):
        text = f'turn {i}: grüße, 日本語 ☕ and "quoted" words\n' * 8
        if i % 2:
            turns.append({"role": "assistant", "content": text})
        else:
            turns.append({"role": "user", "content": [{"type": "text", "text": text}]})
    return turns


def test_a_long_conversation_is_read_and_forwarded_whole(
    target: Target, mock: tuple[MockProvider, str]
) -> None:
    turns = _long_conversation()
    raw = _anthropic(target).messages.with_raw_response.create(
        model="m-ok", max_tokens=32, messages=turns
    )
    assert raw.parse().content[0].type == "text"
    assert raw.headers["x-switchyard-account"] == "ok"
    assert raw.headers["x-switchyard-attempts"] == "1"
    chat = _openai(target).chat.completions.with_raw_response.create(model="m-ok", messages=turns)
    assert chat.parse().choices[0].message.content
    sent = [msgspec.json.decode(r.body) for r in mock[0].requests]
    assert len(sent) == 2
    assert all(len(r.body) >= 16384 for r in mock[0].requests)
    assert all(body["messages"] == turns and body["model"] == "m-ok" for body in sent)
