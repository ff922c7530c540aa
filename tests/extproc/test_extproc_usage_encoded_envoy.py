"""Token usage of compressed and long answers through a real Envoy (the example envoy.yaml).

Providers compress what they send when the client accepts it (the SDKs send
`accept-encoding: gzip, deflate`), and Envoy passes the compressed body on: the processor reads
the usage of a gzip or deflate answer or stream by decompressing it as it passes, and of a JSON
answer too long to hold as it passes. An answer it cannot read (an encoding zlib cannot undo,
more than the bound once decompressed) reaches the client unchanged and counts in
`switchyard.usage.unread`. The upstream is the mock provider behind a small compressing layer
that answers in the encoding the request accepts, as a provider does.
"""

from __future__ import annotations

import gzip
import time
import zlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anthropic
import httpx
import msgspec
import openai
import pytest
import pytest_asyncio

from conftest import Metrics
from envoy_rig import Rig, StartRig
from servers import serve_in_thread
from switchyard_mw.extproc import body_usage
from switchyard_mw.telemetry import names as tm
from switchyard_mw.telemetry import request_metrics as rm
from switchyard_mw.testing import MockProvider
from usage_streams import all_input

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]
LABELS = {tm.REQUEST_MODEL: "enc-model", tm.RESPONSE_MODEL: "enc-model", tm.ACCOUNT: "key-a"}
TURN: Any = [{"role": "user", "content": "How many tokens is this?"}]
REPLY = "Compressed tokens, one after another, in several chunks. " * 20
PAD = "x-test-pad"
"""A request header the compressing layer reads: pad the JSON answer's text to this length."""


def config_text(mock_url: str) -> str:
    return f"""
[llm_clients.key-a]
base_url = "{mock_url}"
api_key_env = "KEY_A"
models = ["enc-model"]
envoy_cluster = "mock"
"""


class Compressing:
    """An ASGI layer that compresses the app's answers as a provider does: in the first of
    gzip, deflate, br the request accepts; a stream flushed after every piece, a JSON answer
    whole with its content-length. `br` is labelled only (no brotli here): the processor must
    not read it, and the client, which cannot decode br either, takes it as it is."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        headers = dict(scope.get("headers") or [])
        accepted = [a.strip() for a in headers.get(b"accept-encoding", b"").split(b",")]
        encoding = next((e for e in (b"gzip", b"deflate", b"br") if e in accepted), None)
        pad = int(headers.get(PAD.encode(), b"0"))
        if encoding is None and not pad:
            await self.app(scope, receive, send)
            return
        layer = _Layer(send, encoding, pad)
        await self.app(scope, receive, layer.send)


class _Layer:
    def __init__(self, send: Any, encoding: bytes | None, pad: int) -> None:
        self.out, self.encoding, self.pad = send, encoding, pad
        self.start: dict[str, Any] = {}
        self.stream = False
        self.body = b""
        self.packer = zlib.compressobj(wbits=31 if encoding == b"gzip" else 15)

    def pack(self, data: bytes, last: bool) -> bytes:
        if self.encoding in (None, b"br"):
            return data
        out = self.packer.compress(data)
        return out + self.packer.flush(zlib.Z_FINISH if last else zlib.Z_SYNC_FLUSH)

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.start = message
            kind = dict(message["headers"]).get(b"content-type", b"")
            self.stream = kind.startswith(b"text/event-stream")
            if self.stream:
                await self.out({**message, "headers": self.headers(message, None)})
            return
        last = not message.get("more_body", False)
        if self.stream:
            await self.out({**message, "body": self.pack(message.get("body", b""), last)})
            return
        self.body += message.get("body", b"")
        if not last:
            return
        body = self.padded(self.body) if self.pad else self.body
        body = self.pack(body, True)
        await self.out({**self.start, "headers": self.headers(self.start, len(body))})
        await self.out({"type": "http.response.body", "body": body})

    def padded(self, body: bytes) -> bytes:
        answer = msgspec.json.decode(body)
        answer["content"][0]["text"] = "y" * self.pad
        return msgspec.json.encode(answer)

    def headers(self, start: dict[str, Any], length: int | None) -> list[tuple[bytes, bytes]]:
        kept = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
        if self.encoding is not None:
            kept.append((b"content-encoding", self.encoding))
        if length is not None:
            kept.append((b"content-length", str(length).encode()))
        return kept


@pytest.fixture(scope="module")
def mock_server() -> Iterator[tuple[MockProvider, str]]:
    """The mock, behind the compressing layer."""
    mock = MockProvider(reply=REPLY)
    with serve_in_thread(Compressing(mock)) as url:
        yield mock, url


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def rig(start_rig: StartRig) -> AsyncIterator[Rig]:
    async with start_rig(config_text, {"KEY_A": "key-a"}) as rig:
        yield rig


def gained(before: dict[str, tuple[int, float]]) -> dict[str, tuple[int, float]]:
    after = read()
    out = {}
    for name, (count, total) in after.items():
        was_count, was_total = before.get(name, (0, 0.0))
        if count != was_count:
            out[name] = (count - was_count, total - was_total)
    return out


def read() -> dict[str, tuple[int, float]]:
    """(count, sum) of the processor's token usage by type, and its request count."""
    out: dict[str, tuple[int, float]] = {}
    rm.requests.fold()
    now = time.time_ns()
    for tally, kind in ((rm.token_usage, None), (rm.duration, "duration")):
        metric = tally.metric(now)
        for point in metric.data.data_points if metric is not None else ():
            attributes = dict(point.attributes or {})
            name = kind or str(attributes.pop(tm.TOKEN_TYPE, ""))
            attributes.pop(tm.VARIANT, None)
            if attributes == LABELS:
                out[name] = (point.count, point.sum)
    return out


def tokens(before: dict[str, tuple[int, float]]) -> tuple[float | None, float | None]:
    got = gained(before)
    assert got.get("duration", (0,))[0] == 1, got  # one request, no error type
    return tuple(got[k][1] if k in got else None for k in ("input", "output"))  # type: ignore[return-value]


def unread(metrics: Metrics, reason: str) -> float:
    labels = {tm.RESPONSE_MODEL: "enc-model", tm.ACCOUNT: "key-a", "reason": reason}
    return metrics.value(tm.USAGE_UNREAD, **labels)


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_a_compressed_json_answer_through_the_sdk(rig: Rig, encoding: str) -> None:
    before = read()
    async with anthropic.AsyncAnthropic(
        base_url=rig.envoy_url,
        api_key="caller",
        max_retries=0,
        default_headers={"accept-encoding": encoding},
    ) as claude:
        response = await claude.messages.with_raw_response.create(
            model="enc-model", max_tokens=500, messages=TURN
        )
    assert response.headers["content-encoding"] == encoding  # compressed on the wire
    message = await response.parse()
    assert message.content[0].text == REPLY  # type: ignore[union-attr]
    assert tokens(before) == (all_input(message.usage), message.usage.output_tokens)


async def test_a_gzip_stream_through_the_sdk(rig: Rig) -> None:
    before = read()
    async with openai.AsyncOpenAI(
        base_url=f"{rig.envoy_url}/v1",
        api_key="caller",
        max_retries=0,
        default_headers={"accept-encoding": "gzip"},
    ) as gpt:
        stream = await gpt.chat.completions.create(
            model="enc-model", messages=TURN, stream=True, stream_options={"include_usage": True}
        )
        text, usage = "", None
        async for chunk in stream:
            text += "".join(c.delta.content or "" for c in chunk.choices)
            usage = chunk.usage or usage
    assert text == REPLY
    assert usage is not None
    assert tokens(before) == (usage.prompt_tokens, usage.completion_tokens)


@pytest.mark.parametrize("encoding", ["identity", "gzip"])
async def test_a_json_answer_over_the_whole_answer_bound(rig: Rig, encoding: str) -> None:
    """Over 512 KiB as sent: read as it passes; the client gets every byte."""
    pad = 2 * body_usage.WHOLE_ANSWER_MAX
    body = {"model": "enc-model", "max_tokens": 50, "messages": TURN}
    before = read()
    headers = {PAD: str(pad), "accept-encoding": encoding if encoding != "identity" else "x"}
    async with httpx.AsyncClient(base_url=rig.envoy_url, timeout=30) as http:
        answer = await http.post("/v1/messages", json=body, headers=headers)
    assert answer.status_code == 200
    sent = answer.json()
    assert sent["content"][0]["text"] == "y" * pad
    # Read piece by piece, the answer still arrives with its length (Envoy 1.40 keeps it).
    assert int(answer.headers["content-length"]) == answer.num_bytes_downloaded
    if encoding == "identity":  # a long plain answer: over the bound as sent
        assert len(answer.content) > body_usage.WHOLE_ANSWER_MAX
    usage = sent["usage"]
    assert tokens(before) == (all_input(usage), usage["output_tokens"])


async def test_a_decompression_bomb_is_counted_unread(rig: Rig, otel_metrics: Metrics) -> None:
    """4 MiB of one letter, gzip: 4 KiB on the wire, over what one piece may inflate to."""
    pad = 4 << 20
    body = {"model": "enc-model", "max_tokens": 50, "messages": TURN}
    before, too_large = read(), unread(otel_metrics, "too_large")
    async with httpx.AsyncClient(base_url=rig.envoy_url, timeout=30) as http:
        answer = await http.post(
            "/v1/messages", json=body, headers={PAD: str(pad), "accept-encoding": "gzip"}
        )
    assert answer.status_code == 200
    assert answer.headers["content-encoding"] == "gzip"
    assert len(answer.json()["content"][0]["text"]) == pad  # the client gets it whole
    assert tokens(before) == (None, None)
    assert unread(otel_metrics, "too_large") == too_large + 1


async def test_a_br_answer_passes_unchanged_and_is_counted_unread(
    rig: Rig, otel_metrics: Metrics
) -> None:
    body = {"model": "enc-model", "max_tokens": 50, "messages": TURN}
    before, encoding = read(), unread(otel_metrics, "encoding")
    async with httpx.AsyncClient(base_url=rig.envoy_url, timeout=10) as http:
        answer = await http.post("/v1/messages", json=body, headers={"accept-encoding": "br"})
    assert answer.status_code == 200
    assert answer.headers["content-encoding"] == "br"
    assert answer.headers["content-length"] == str(len(answer.content))
    assert tokens(before) == (None, None)
    assert unread(otel_metrics, "encoding") == encoding + 1


async def test_a_gzip_answer_reaches_the_client_as_sent(rig: Rig) -> None:
    """Read whole (BUFFERED) for its usage, the compressed answer keeps its length and bytes."""
    body = {"model": "enc-model", "max_tokens": 50, "messages": TURN}
    async with (
        httpx.AsyncClient(base_url=rig.envoy_url, timeout=10) as http,
        http.stream("POST", "/v1/messages", json=body, headers={"accept-encoding": "gzip"}) as r,
    ):
        raw = b"".join([piece async for piece in r.aiter_raw()])
    assert r.headers["content-length"] == str(len(raw))
    assert msgspec.json.decode(gzip.decompress(raw))["content"][0]["text"] == REPLY
