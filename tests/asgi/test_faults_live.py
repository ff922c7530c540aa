"""The fault matrix, through real servers: what the client gets, what cooling records, and that
nothing is left behind.

The example gateway runs under uvicorn in a subprocess with two accounts for one model: `faulty`
(preferred) points at a raw TCP server that misbehaves on purpose, `good` at the mock provider.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from servers import example_gateway, free_port, serve_in_thread, wait_for_port
from switchyard_mw.testing import Behaviour, MockProvider

SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
    b"connection: close\r\n\r\n"
)
MESSAGE_START = (
    b'event: message_start\ndata: {"type":"message_start","message":{"id":"m","type":"message",'
    b'"role":"assistant","model":"fault-model","content":[],"stop_reason":null,'
    b'"stop_sequence":null,"usage":{"input_tokens":1,"output_tokens":1}}}\n\n'
)
TEXT_START = (
    b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
    b'"content_block":{"type":"text","text":""}}\n\n'
)
TEXT_DELTA = (
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
    b'"delta":{"type":"text_delta","text":"Hel"}}\n\n'
)

pytestmark = pytest.mark.integration  # starts real servers
HUGE_BYTES = 8 * 1024 * 1024


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


class FaultServer:
    """A raw HTTP/1.1 server that reads a request, then fails in the way `mode` says."""

    def __init__(self) -> None:
        self.mode = "reset_before_headers"
        self.port = free_port()
        self.hits = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", self.port)
        )
        self._server = server
        self._loop.run_forever()

    def start(self) -> None:
        self._thread.start()
        wait_for_port(self.port)

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            await reader.readexactly(length)
            self.hits += 1
            await getattr(self, f"_{self.mode}")(writer)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _reset_before_headers(self, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        # SO_LINGER 0: the close sends RST, a real reset rather than a polite FIN.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    async def _close_after_headers(self, writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 500\r\n"
            b"connection: close\r\n\r\n{"
        )
        await writer.drain()

    async def _die_mid_stream(self, writer: asyncio.StreamWriter) -> None:
        # After a first content event: the stream has started, so nothing can replace it.
        writer.write(
            SSE_HEAD
            + chunk(MESSAGE_START)
            + chunk(TEXT_START)
            + chunk(TEXT_DELTA)
            + b"40\r\nevent: content_block_"
        )
        await writer.drain()

    async def _die_before_content(self, writer: asyncio.StreamWriter) -> None:
        # Its opening events only: the client has seen nothing of it yet.
        writer.write(SSE_HEAD + chunk(MESSAGE_START) + chunk(TEXT_START) + b"40\r\nevent: ping")
        await writer.drain()

    async def _malformed_sse(self, writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD + chunk(MESSAGE_START) + chunk(b"data: {not json\n\n") + b"0\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.1)

    async def _huge_json(self, writer: asyncio.StreamWriter) -> None:
        body = json.dumps(
            {
                "id": "m",
                "type": "message",
                "role": "assistant",
                "model": "fault-model",
                "content": [{"type": "text", "text": "x" * HUGE_BYTES}],
                "stop_reason": "end_turn",
                "stop_sequence": None,
                "usage": {"input_tokens": 1, "output_tokens": 1},
            }
        ).encode()
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()


@pytest.fixture(scope="module")
def faults() -> Iterator[FaultServer]:
    server = FaultServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def mock() -> Iterator[tuple[MockProvider, str]]:
    provider = MockProvider()
    with serve_in_thread(provider) as url:
        yield provider, url


@pytest.fixture(scope="module")
def gateway(
    faults: FaultServer, mock: tuple[MockProvider, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    config = f"""
[llm_clients.faulty]
base_url = "http://127.0.0.1:{faults.port}"
models = ["fault-model"]
priority = 0
failure_threshold = 1000

[llm_clients.good]
base_url = "{mock[1]}"
api_key_env = "GOOD_KEY"
models = ["fault-model", "judge-model", "fallback-model", "picked-model"]
priority = 1

[routes.judged]
classifier = "llm"
judge = "good"
judge_model = "judge-model"
judge_deadline_ms = 2000
choices = {{ pick = "picked-model" }}
fallback = "fallback-model"
"""
    with example_gateway(
        config, tmp_path_factory.mktemp("faults"), {"GOOD_KEY": "good-key"}
    ) as url:
        yield url


def faults_of(gateway: str, name: str) -> int:
    accounts = httpx.get(f"{gateway}/switchyard/accounts").json()["accounts"]
    return int(next(a for a in accounts if a["name"] == name)["consecutive_faults"])


def health(gateway: str) -> dict[str, Any]:
    data: dict[str, Any] = httpx.get(f"{gateway}/switchyard/health").json()
    return data


@pytest.fixture(autouse=True)
def reset(mock: tuple[MockProvider, str]) -> None:
    mock[0].reset()


REQUEST = {
    "model": "fault-model",
    "max_tokens": 20,
    "messages": [{"role": "user", "content": "hi"}],
}


@pytest.mark.parametrize("mode", ["reset_before_headers", "close_after_headers"])
def test_upstream_dies_before_the_answer_started_fails_over(
    gateway: str, faults: FaultServer, mode: str
) -> None:
    faults.mode = mode
    before = faults_of(gateway, "faulty")
    r = httpx.post(f"{gateway}/v1/messages", json=REQUEST, timeout=10)
    assert r.status_code == 200
    assert r.json()["model"] == "fault-model"
    assert r.headers["x-switchyard-account"] == "good"
    assert r.headers["x-switchyard-attempts"] == "2"
    assert faults_of(gateway, "faulty") == before + 1


async def test_upstream_dies_mid_stream_ends_with_a_wire_error_event(
    gateway: str, faults: FaultServer
) -> None:
    faults.mode = "die_mid_stream"
    before = faults_of(gateway, "faulty")
    client = anthropic.AsyncAnthropic(base_url=gateway, api_key="k", max_retries=0)

    async def consume() -> None:
        async with asyncio.timeout(10):
            stream = await client.messages.create(**REQUEST, stream=True)  # type: ignore[call-overload]
            async for _ in stream:
                pass

    with pytest.raises(anthropic.APIStatusError) as info:  # the SDK raises the error event
        await consume()
    assert info.value.body["error"]["type"] == "upstream_error"  # type: ignore[index]
    assert faults_of(gateway, "faulty") == before + 1
    await client.close()


def test_upstream_dies_before_the_first_content_event_fails_over(
    gateway: str, faults: FaultServer
) -> None:
    """A stream starts at its first content event: one that breaks before it is no answer
    yet, and the next account gives the whole of one."""
    faults.mode = "die_before_content"
    before = faults_of(gateway, "faulty")
    client = anthropic.Anthropic(base_url=gateway, api_key="k", max_retries=0, timeout=10)
    with client.messages.stream(**REQUEST) as stream:  # type: ignore[arg-type]
        message = stream.get_final_message()
    assert message.content[0].type == "text"
    assert message.content[0].text  # the good account's whole answer
    assert stream.response.headers["x-switchyard-account"] == "good"
    assert stream.response.headers["x-switchyard-attempts"] == "2"
    assert faults_of(gateway, "faulty") == before + 1


def test_malformed_sse_frame_passes_through_byte_for_byte(
    gateway: str, faults: FaultServer
) -> None:
    faults.mode = "malformed_sse"
    r = httpx.post(f"{gateway}/v1/messages", json={**REQUEST, "stream": True}, timeout=10)
    assert r.status_code == 200
    assert b"data: {not json\n\n" in r.content
    assert faults_of(gateway, "faulty") == 0  # a 200 is a success: the count resets


def test_huge_upstream_body_arrives_whole(gateway: str, faults: FaultServer) -> None:
    faults.mode = "huge_json"
    r = httpx.post(f"{gateway}/v1/messages", json=REQUEST, timeout=30)
    assert r.status_code == 200
    assert len(r.json()["content"][0]["text"]) == HUGE_BYTES


def test_judge_garbage_fails_open(gateway: str, mock: tuple[MockProvider, str]) -> None:
    mock[0].set_behaviour("good-key", Behaviour(reply="definitely not a label " * 100))
    r = httpx.post(
        f"{gateway}/v1/chat/completions",
        json={"model": "judged", "messages": [{"role": "user", "content": "route me"}]},
        timeout=10,
    )
    assert r.status_code == 200
    assert r.headers["x-switchyard-route"] == "fail_open:bad_verdict"
    assert r.json()["model"] == "fallback-model"


def _wait_idle(mock: MockProvider) -> None:
    """Poll the mock (on another thread) until its handlers have ended, 5 s at most."""
    end = time.monotonic() + 5
    while mock.in_flight and time.monotonic() < end:
        time.sleep(0.05)


async def test_client_leaving_during_the_upstream_call_cancels_it(
    gateway: str, faults: FaultServer, mock: tuple[MockProvider, str]
) -> None:
    faults.mode = "reset_before_headers"
    provider = mock[0]
    provider.set_behaviour("good-key", Behaviour(headers_delay_secs=30))
    with contextlib.suppress(httpx.TimeoutException):
        async with httpx.AsyncClient(timeout=1.0) as http:
            await http.post(f"{gateway}/v1/messages", json=REQUEST)
    _wait_idle(provider)
    assert provider.in_flight == 0  # the gateway hung up on the upstream at once
    assert faults_of(gateway, "good") == 0  # a client leaving is nobody's fault


async def test_client_leaving_mid_stream_cancels_the_upstream_stream(
    gateway: str, faults: FaultServer, mock: tuple[MockProvider, str]
) -> None:
    faults.mode = "reset_before_headers"
    provider = mock[0]
    provider.set_behaviour("good-key", Behaviour(chunks=200, chunk_interval_secs=0.05))
    async with (
        httpx.AsyncClient(timeout=10) as http,
        http.stream("POST", f"{gateway}/v1/messages", json={**REQUEST, "stream": True}) as r,
    ):
        assert r.status_code == 200
        async for _ in r.aiter_raw():
            break  # one chunk, then leave
    await asyncio.sleep(0.2)
    _wait_idle(provider)
    assert provider.in_flight == 0


def test_nothing_is_left_behind(gateway: str, faults: FaultServer) -> None:
    """After every fault above, the gateway's tasks and descriptors come back to a baseline."""
    faults.mode = "reset_before_headers"
    time.sleep(0.5)
    baseline = health(gateway)
    for mode in ("reset_before_headers", "close_after_headers", "die_mid_stream"):
        faults.mode = mode
        for _ in range(5):
            httpx.post(
                f"{gateway}/v1/messages",
                json={**REQUEST, "stream": mode == "die_mid_stream"},
                timeout=10,
            )
    time.sleep(0.5)
    after = health(gateway)
    assert after["tasks"] <= baseline["tasks"]
    assert after["open_fds"] <= baseline["open_fds"] + 2  # keep-alive pool may hold one more
