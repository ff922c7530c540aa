"""Token usage from the response bodies that pass through the ext_proc processor.

At the response headers of a successful answer the processor asks Envoy for the body: an event
stream piece by piece as it passes (STREAMED), a JSON answer of known and modest length whole
(BUFFERED, which keeps its `content-length`), any other JSON answer piece by piece; a gzip or
deflate body is decompressed as it is read, a bounded amount. Each piece is answered at once
and unchanged. When the body ends, its usage goes into the request metrics with the request's
labels and onto the request's and attempt's spans, and the request's telemetry ends there.
What cannot be read is counted as no usage, never an error; an answer that had usage and could
not be read (an encoding zlib cannot undo, too long decompressed) counts in
`switchyard.usage.unread`.
"""

from __future__ import annotations

import base64
import gzip
import random
import time
import zlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conftest import Metrics
from extproc_child import CountingPool
from extproc_helpers import (
    Stream,
    request_body,
    request_headers,
    response_body,
    response_headers,
    sets,
)
from switchyard_mw._protos.envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from switchyard_mw._protos.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from switchyard_mw.accounts import build_accounts, pool_from_accounts
from switchyard_mw.config import parse_config
from switchyard_mw.extproc import ExtProcServicer, Policies, body_usage
from switchyard_mw.extproc.flights import Flights
from switchyard_mw.telemetry import names as tm
from switchyard_mw.telemetry import request_metrics as rm
from switchyard_mw.testing import MockProvider
from usage_streams import ANTHROPIC_STREAM, CHAT_STREAM, RESPONSES_STREAM, all_input

Mode = processing_mode_pb2.ProcessingMode
CONFIG = """
[llm_clients.a]
base_url = "https://prov.example"
api_key_env = "KEY_A"
models = ["use-base", "use-var"]
envoy_cluster = "prov"

[canaries."use-base"]
variants = { "use-var" = 100.0 }
"""
ENV = {"KEY_A": "ka"}
TURN = [{"role": "user", "content": "hi"}]
REQUESTS = {
    "/v1/messages": {"model": "use-base", "max_tokens": 8, "messages": TURN},
    "/v1/chat/completions": {"model": "use-base", "messages": TURN},
    "/v1/responses": {"model": "use-base", "input": "hi"},
}
STREAMS = {
    "/v1/messages": (ANTHROPIC_STREAM, (15, 42)),
    "/v1/chat/completions": (CHAT_STREAM, (7, 3)),
    "/v1/responses": (RESPONSES_STREAM, (8, 9)),
}
ANSWERS = {
    "/v1/messages": ({"usage": {"input_tokens": 30, "output_tokens": 4}}, (30, 4)),
    "/v1/chat/completions": ({"usage": {"prompt_tokens": 12, "completion_tokens": 5}}, (12, 5)),
    "/v1/responses": ({"usage": {"input_tokens": 7, "output_tokens": 2}}, (7, 2)),
}
SSE = {"content-type": "text/event-stream; charset=utf-8"}
# The request's labels: asked for the base, routed to the canary's variant, on account a.
LABELS = {
    tm.REQUEST_MODEL: "use-base",
    tm.RESPONSE_MODEL: "use-var",
    tm.VARIANT: "use-var",
    tm.ACCOUNT: "a",
}


class Env:
    def __init__(self, servicer: ExtProcServicer, pool: CountingPool) -> None:
        self.servicer, self.pool = servicer, pool

    async def answered(
        self,
        path: str,
        status: int,
        headers: dict[str, str],
        *,
        end: bool = False,
        streamed: bool = False,
    ) -> tuple[Stream, ep.ProcessingResponse]:
        """A stream through its request and its response headers: (stream, headers' answer)."""
        stream = Stream(self.servicer)
        await stream.send(request_headers(path))
        asked = {**REQUESTS[path], "stream": True} if streamed else REQUESTS[path]
        routed = await stream.send(request_body(msgspec.json.encode(asked)))
        assert sets(routed)["x-switchyard-cluster"] == b"prov"
        answer = await stream.send(
            response_headers(status, headers, details="via_upstream", end=end)
        )
        return stream, answer

    def assert_empty(self) -> None:
        assert len(self.servicer.flights) == 0
        assert self.pool.out == 0


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    config = parse_config(CONFIG)
    accounts = build_accounts(config, ENV)
    pool = CountingPool(pool_from_accounts(accounts).specs)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=MockProvider()))
    policies = Policies(config, accounts, pool=pool, judge_http_client=http)
    yield Env(ExtProcServicer(policies, Flights()), pool)
    await http.aclose()


def tokens(**extra: str) -> dict[str, tuple[int, float]]:
    """(count, sum) of `gen_ai.client.token.usage` by token type, for the request's labels."""
    rm.requests.fold()  # finished requests are held raw until a collection folds them
    metric = rm.token_usage.metric(time.time_ns())
    wanted = {**LABELS, **extra}
    out = {}
    for point in metric.data.data_points if metric is not None else ():
        attributes = dict(point.attributes or {})
        kind = attributes.pop(tm.TOKEN_TYPE, None)
        if attributes == wanted and isinstance(kind, str):
            out[kind] = (point.count, point.sum)
    return out


def durations(**extra: str) -> int:
    return _count(rm.duration, **extra)


def first_tokens(**extra: str) -> int:
    return _count(rm.time_to_first_token, **extra)


def _count(tally: rm.HistogramTally, **extra: str) -> int:
    rm.requests.fold()  # finished requests are held raw until a collection folds them
    metric = tally.metric(time.time_ns())
    wanted = {**LABELS, **extra}
    points = metric.data.data_points if metric is not None else ()
    return sum(p.count for p in points if dict(p.attributes or {}) == wanted)


def grew(before: dict[str, tuple[int, float]], after: dict[str, tuple[int, float]]) -> Any:
    """What one request added: (input, output) tokens, None for a type it did not add to."""

    def added(kind: str) -> float | None:
        count, total = after.get(kind, (0, 0.0))
        was_count, was_total = before.get(kind, (0, 0.0))
        return None if count == was_count else total - was_total

    return added("input"), added("output")


def unchanged_body_answer(answer: ep.ProcessingResponse) -> bool:
    return answer.WhichOneof("response") == "response_body" and not answer.response_body.HasField(
        "response"
    )


@pytest.mark.parametrize("path", list(STREAMS))
async def test_a_stream_is_read_piece_by_piece_and_passes_unchanged(env: Env, path: str) -> None:
    stream_bytes, expected = STREAMS[path]
    before, runs = tokens(), durations()
    stream, answer = await env.answered(path, 200, SSE)
    assert answer.mode_override.response_body_mode == Mode.STREAMED
    assert sets(answer)["x-switchyard-model"] == b"use-var"  # the headers' answer as ever
    assert durations() == runs  # the request is not over: its body is still to come
    assert len(env.servicer.flights) == 0  # but no attempt can follow: it is not findable
    pieces = [stream_bytes[i : i + 5] for i in range(0, len(stream_bytes), 5)]
    for piece in pieces:  # events cut across pieces
        assert unchanged_body_answer(await stream.send(response_body(piece)))
    assert tokens() == before
    assert unchanged_body_answer(await stream.send(response_body(b"", end=True)))
    assert grew(before, tokens()) == expected
    assert durations() == runs + 1
    await stream.close()
    assert durations() == runs + 1  # recorded once
    env.assert_empty()


@pytest.mark.parametrize("path", list(STREAMS))
async def test_a_streams_first_delta_is_its_first_token(env: Env, path: str) -> None:
    stream_bytes, _ = STREAMS[path]
    firsts = first_tokens()
    stream, _ = await env.answered(path, 200, SSE, streamed=True)
    events = [e + b"\n\n" for e in stream_bytes.split(b"\n\n") if e]
    for event in events:
        await stream.send(response_body(event))
        # Recorded with the request, once, from the first piece that carries a delta.
    assert first_tokens() == firsts
    await stream.send(response_body(b"", end=True))
    assert first_tokens() == firsts + 1
    await stream.close()
    env.assert_empty()


@pytest.mark.parametrize("path", list(ANSWERS))
async def test_a_json_answer_of_known_length_is_read_whole(env: Env, path: str) -> None:
    answer_json, expected = ANSWERS[path]
    body = msgspec.json.encode({"id": "x", **answer_json})
    before = tokens()
    headers = {"content-type": "application/json", "content-length": str(len(body))}
    stream, answer = await env.answered(path, 200, headers)
    # Buffered, so Envoy keeps the answer's content-length.
    assert answer.mode_override.response_body_mode == Mode.BUFFERED
    assert unchanged_body_answer(await stream.send(response_body(body, end=True)))
    assert grew(before, tokens()) == expected
    await stream.close()
    env.assert_empty()


async def test_a_json_answer_of_unknown_length_is_read_as_it_passes(env: Env) -> None:
    answer_json, expected = ANSWERS["/v1/chat/completions"]
    body = msgspec.json.encode({"id": "x", "choices": [], **answer_json})
    before = tokens()
    stream, answer = await env.answered(
        "/v1/chat/completions", 200, {"content-type": "application/json"}
    )
    assert answer.mode_override.response_body_mode == Mode.STREAMED
    for i in range(0, len(body), 4):
        assert unchanged_body_answer(await stream.send(response_body(body[i : i + 4])))
    assert unchanged_body_answer(await stream.send(response_body(b"", end=True)))
    assert grew(before, tokens()) == expected
    await stream.close()
    env.assert_empty()


NOT_READ = {
    "an error": (500, {"content-type": "application/json"}),
    "a throttle": (429, {"content-type": "application/json"}),
    "neither JSON nor a stream": (200, {"content-type": "text/plain"}),
    "no content type": (200, {}),
}


@pytest.mark.parametrize(("status", "headers"), NOT_READ.values(), ids=NOT_READ.keys())
async def test_an_answer_without_usage_to_read_is_not_asked_for(
    env: Env, status: int, headers: dict[str, str]
) -> None:
    runs = durations(**({tm.ERROR_TYPE: str(status)} if status >= 400 else {}))
    stream, answer = await env.answered("/v1/messages", status, headers)
    assert not answer.HasField("mode_override")
    # The request ended at its response headers, as before.
    assert durations(**({tm.ERROR_TYPE: str(status)} if status >= 400 else {})) == runs + 1
    assert len(env.servicer.flights) == 0
    await stream.close()
    env.assert_empty()


async def test_an_answer_with_no_body_ends_at_its_headers(env: Env) -> None:
    runs = durations()
    stream, answer = await env.answered("/v1/messages", 200, SSE, end=True)
    assert not answer.HasField("mode_override")
    assert durations() == runs + 1
    await stream.close()
    env.assert_empty()


GARBAGE = [
    b"\x00\xff\xfe" * 5000,
    b'data: {"usage": {"input_tokens": "many"}}\n\n',
    b'event: message_delta\ndata: {"usage": {"output_tokens": 3\n\n',
    b"<html>502 Bad Gateway</html>",
]


@pytest.mark.parametrize("garbage", GARBAGE)
@pytest.mark.parametrize("json", [False, True], ids=["stream", "json"])
async def test_a_body_that_cannot_be_read_passes_unchanged_as_no_usage(
    env: Env, garbage: bytes, json: bool
) -> None:
    before, runs = tokens(), durations()
    headers = {"content-type": "application/json"} if json else SSE
    stream, _ = await env.answered("/v1/messages", 200, headers)
    for i in range(0, len(garbage), 1000):
        assert unchanged_body_answer(await stream.send(response_body(garbage[i : i + 1000])))
    assert unchanged_body_answer(await stream.send(response_body(b"", end=True)))
    assert tokens() == before
    assert durations() == runs + 1  # a success all the same: no error type
    await stream.close()
    env.assert_empty()


async def test_a_stream_cut_off_mid_body_ends_its_telemetry_and_leaves_nothing(
    env: Env, otel_spans: InMemorySpanExporter
) -> None:
    before, runs = tokens(), durations()
    stream, _ = await env.answered("/v1/messages", 200, SSE)
    await stream.send(response_body(ANTHROPIC_STREAM[:200]))  # message_start, input tokens
    await stream.close()  # Envoy ends the stream: the client left
    assert durations() == runs + 1
    assert grew(before, tokens()) == (15, 1)  # what message_start said before the cut
    ended = {span.name for span in otel_spans.get_finished_spans()}
    assert {tm.SPAN_REQUEST, tm.SPAN_ATTEMPT, tm.SPAN_CLIENT.format(model="use-var")} <= ended
    env.assert_empty()


@pytest.mark.parametrize("json", [False, True], ids=["stream", "json"])
async def test_usage_is_on_the_request_span_and_the_attempts_client_span(
    env: Env, otel_spans: InMemorySpanExporter, json: bool
) -> None:
    if json:
        body = msgspec.json.encode(ANSWERS["/v1/messages"][0])
        headers = {"content-type": "application/json", "content-length": str(len(body))}
        expected = ANSWERS["/v1/messages"][1]
    else:
        body, expected = STREAMS["/v1/messages"]
        headers = SSE
    stream, _ = await env.answered("/v1/messages", 200, headers)
    assert not otel_spans.get_finished_spans()  # nothing ends before the body does
    await stream.send(response_body(body, end=True))
    await stream.close()
    spans = {span.name: span for span in otel_spans.get_finished_spans()}
    for name in (tm.SPAN_REQUEST, tm.SPAN_CLIENT.format(model="use-var")):
        attributes = spans[name].attributes or {}
        assert (
            attributes.get(tm.USAGE_INPUT_TOKENS),
            attributes.get(tm.USAGE_OUTPUT_TOKENS),
        ) == expected, name
    attempt = spans[tm.SPAN_ATTEMPT].attributes or {}
    assert attempt.get(tm.ATTEMPT_STATUS) == "200"
    env.assert_empty()


# --- compressed answers, long answers ---------------------------------------------------------


def unread(metrics: Metrics, reason: str) -> float:
    """`switchyard.usage.unread` for the request's routed model and account, by reason."""
    labels = {tm.RESPONSE_MODEL: "use-var", tm.ACCOUNT: "a", "reason": reason}
    return metrics.value(tm.USAGE_UNREAD, **labels)


def gzip_members(*parts: bytes) -> bytes:
    return b"".join(gzip.compress(part) for part in parts)


def raw_deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(wbits=-15)
    return packer.compress(data) + packer.flush()


ENCODERS = {
    "gzip": gzip.compress,
    "x-gzip": gzip.compress,
    "deflate": zlib.compress,  # the zlib format, as HTTP means deflate
    "deflate (raw)": raw_deflate,  # what some servers send as deflate
}


def encoding_of(name: str) -> str:
    return name.split(" ")[0]


def pieces(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


@pytest.mark.parametrize("size", [1, 7, 1 << 20], ids=["bytewise", "small", "whole"])
@pytest.mark.parametrize("name", list(ENCODERS))
async def test_a_compressed_json_answer_is_read(env: Env, name: str, size: int) -> None:
    answer_json, expected = ANSWERS["/v1/messages"]
    body = ENCODERS[name](msgspec.json.encode({"id": "x", "content": [], **answer_json}))
    before = tokens()
    headers = {
        "content-type": "application/json",
        "content-encoding": encoding_of(name),
        "content-length": str(len(body)),
    }
    stream, answer = await env.answered("/v1/messages", 200, headers)
    assert answer.mode_override.response_body_mode == Mode.BUFFERED
    for piece in pieces(body, size):
        assert unchanged_body_answer(await stream.send(response_body(piece)))
    assert unchanged_body_answer(await stream.send(response_body(b"", end=True)))
    assert grew(before, tokens()) == expected
    await stream.close()
    env.assert_empty()


@pytest.mark.parametrize("path", list(STREAMS))
async def test_a_gzip_stream_is_read_as_it_passes(env: Env, path: str) -> None:
    """Compressed as a server compresses a stream: flushed after each event."""
    stream_bytes, expected = STREAMS[path]
    packer = zlib.compressobj(wbits=31)
    events = [e + b"\n\n" for e in stream_bytes.split(b"\n\n") if e]
    flushed = [packer.compress(e) + packer.flush(zlib.Z_SYNC_FLUSH) for e in events]
    flushed.append(packer.flush())
    before = tokens()
    stream, answer = await env.answered(path, 200, {**SSE, "content-encoding": "gzip"})
    assert answer.mode_override.response_body_mode == Mode.STREAMED
    for piece in flushed:
        assert unchanged_body_answer(await stream.send(response_body(piece)))
    assert unchanged_body_answer(await stream.send(response_body(b"", end=True)))
    assert grew(before, tokens()) == expected
    await stream.close()
    env.assert_empty()


async def test_several_gzip_members_are_one_body(env: Env) -> None:
    answer_json, expected = ANSWERS["/v1/chat/completions"]
    text = msgspec.json.encode({"id": "x", "choices": [], **answer_json})
    body = gzip_members(text[:10], text[10:])
    before = tokens()
    stream, _ = await env.answered(
        "/v1/chat/completions",
        200,
        {"content-type": "application/json", "content-encoding": "gzip"},
    )
    for piece in pieces(body, 5):
        await stream.send(response_body(piece))
    await stream.send(response_body(b"", end=True))
    assert grew(before, tokens()) == expected
    await stream.close()
    env.assert_empty()


@pytest.mark.parametrize("compressed", [False, True], ids=["plain", "gzip"])
async def test_a_json_answer_too_long_to_hold_is_read_as_it_passes(
    env: Env, compressed: bool
) -> None:
    answer_json, expected = ANSWERS["/v1/messages"]
    text = msgspec.json.encode(
        {"id": "x", "content": [{"type": "text", "text": "y" * (body_usage.WHOLE_ANSWER_MAX)}]}
        | answer_json
    )
    body = gzip.compress(text) if compressed else text
    headers = {"content-type": "application/json", "content-length": str(len(body))}
    if compressed:
        headers["content-encoding"] = "gzip"
    before = tokens()
    stream, answer = await env.answered("/v1/messages", 200, headers)
    expected_mode = Mode.BUFFERED if compressed else Mode.STREAMED  # gzip: 1 MB in 1.5 KB
    assert answer.mode_override.response_body_mode == expected_mode
    for piece in pieces(body, 16 << 10):
        assert unchanged_body_answer(await stream.send(response_body(piece)))
    await stream.send(response_body(b"", end=True))
    assert grew(before, tokens()) == expected
    await stream.close()
    env.assert_empty()


@pytest.mark.parametrize("length", [WHOLE := body_usage.WHOLE_ANSWER_MAX, WHOLE + 1])
async def test_a_json_answer_is_held_whole_up_to_its_bound(env: Env, length: int) -> None:
    headers = {"content-type": "application/json", "content-length": str(length)}
    stream, answer = await env.answered("/v1/messages", 200, headers)
    whole = length <= body_usage.WHOLE_ANSWER_MAX
    assert answer.mode_override.response_body_mode == (Mode.BUFFERED if whole else Mode.STREAMED)
    await stream.close()
    env.assert_empty()


def padded_answer(length: int, filler: bytes = b"y") -> bytes:
    """A JSON answer of exactly `length` bytes with its usage at the end, its text `filler`
    repeated (a single byte compresses a thousandfold; random letters hardly at all)."""
    answer_json, _ = ANSWERS["/v1/messages"]
    shell = msgspec.json.encode({"id": "", **answer_json})
    pad = length - len(shell)
    return shell[:7] + (filler * (pad // len(filler) + 1))[:pad] + shell[7:]


LETTERS = base64.b64encode(random.Random(0).randbytes(3 << 18)).replace(b"/", b"-")
"""1 MiB of random letters: compressed, still about 3/4 of their size."""


async def read_gzip(env: Env, text: bytes, size: int) -> None:
    """One answer, `text` gzip-compressed, sent in pieces of `size` bytes."""
    body = gzip.compress(text, compresslevel=1)
    stream, _ = await env.answered(
        "/v1/messages", 200, {"content-type": "application/json", "content-encoding": "gzip"}
    )
    for piece in pieces(body, size):
        assert unchanged_body_answer(await stream.send(response_body(piece)))
    await stream.send(response_body(b"", end=True))
    await stream.close()
    env.assert_empty()


BOUND = 3 << 20
"""DECODED_MAX in the test below: its edge, without decompressing 64 MiB."""


@pytest.mark.parametrize("length", [BOUND, BOUND + 1], ids=["at", "past"])
async def test_decompression_stops_past_its_bound_and_counts_the_answer_unread(
    env: Env, otel_metrics: Metrics, length: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(body_usage, "DECODED_MAX", BOUND)
    text = padded_answer(length, LETTERS)
    assert len(text) == length
    before, too_large, runs = tokens(), unread(otel_metrics, "too_large"), durations()
    await read_gzip(env, text, 64 << 10)
    within = length <= BOUND
    assert grew(before, tokens()) == (ANSWERS["/v1/messages"][1] if within else (None, None))
    assert unread(otel_metrics, "too_large") == too_large + (0 if within else 1)
    assert durations() == runs + 1  # a success all the same


def one_piece_bound() -> int:
    """The longest answer of single-byte text whose gzip, sent as one piece, decompresses
    within that piece's bound (PIECE_SLACK + PIECE_RATIO * its compressed size)."""
    length = body_usage.PIECE_SLACK
    for _ in range(20):  # the compressed size grows slowly with the length: a fixed point
        compressed = len(gzip.compress(padded_answer(length), compresslevel=1))
        length = body_usage.PIECE_SLACK + body_usage.PIECE_RATIO * compressed
    return length


@pytest.mark.parametrize("extra", [0, 1], ids=["at", "past"])
async def test_a_piece_that_inflates_past_its_bound_stops_the_reading(
    env: Env, otel_metrics: Metrics, extra: int
) -> None:
    """A decompression bomb: one piece may give PIECE_SLACK + PIECE_RATIO times its size."""
    length = one_piece_bound()
    text = padded_answer(length + extra)
    bound = body_usage.PIECE_SLACK + body_usage.PIECE_RATIO * len(
        gzip.compress(text, compresslevel=1)
    )
    assert length + extra - bound == extra  # the same compressed size either side
    before, too_large = tokens(), unread(otel_metrics, "too_large")
    await read_gzip(env, text, len(text))  # in one piece
    within = not extra
    assert grew(before, tokens()) == (ANSWERS["/v1/messages"][1] if within else (None, None))
    assert unread(otel_metrics, "too_large") == too_large + (0 if within else 1)


async def test_a_body_that_does_not_decompress_counts_as_unread(
    env: Env, otel_metrics: Metrics
) -> None:
    before, corrupt = tokens(), unread(otel_metrics, "corrupt")
    stream, _ = await env.answered(
        "/v1/messages", 200, {"content-type": "application/json", "content-encoding": "gzip"}
    )
    invalid = gzip.compress(b"{}")[:10] + b"\xff" * 8  # a gzip header, then a bad block type
    assert unchanged_body_answer(await stream.send(response_body(invalid)))
    await stream.send(response_body(b"", end=True))
    assert tokens() == before
    assert unread(otel_metrics, "corrupt") == corrupt + 1
    await stream.close()
    env.assert_empty()


UNREADABLE = {
    "br": {"content-type": "application/json", "content-encoding": "br"},
    "zstd stream": {**SSE, "content-encoding": "zstd"},
    "stacked": {"content-type": "application/json", "content-encoding": "gzip, br"},
}


@pytest.mark.parametrize("headers", UNREADABLE.values(), ids=UNREADABLE.keys())
async def test_an_encoding_zlib_cannot_undo_is_not_asked_for_and_counted(
    env: Env, otel_metrics: Metrics, headers: dict[str, str]
) -> None:
    runs, encoding = durations(), unread(otel_metrics, "encoding")
    stream, answer = await env.answered("/v1/messages", 200, headers)
    assert not answer.HasField("mode_override")
    assert durations() == runs + 1  # ended at its headers, as before
    assert unread(otel_metrics, "encoding") == encoding + 1
    await stream.close()
    env.assert_empty()


async def test_an_answer_with_nothing_to_read_is_not_counted_unread(
    env: Env, otel_metrics: Metrics
) -> None:
    counts = [unread(otel_metrics, r) for r in ("encoding", "too_large", "corrupt")]
    for status, headers in [
        (200, {"content-type": "text/plain", "content-encoding": "br"}),
        (500, {"content-type": "application/json", "content-encoding": "br"}),
    ]:
        stream, _ = await env.answered("/v1/messages", status, headers)
        await stream.close()
    assert [unread(otel_metrics, r) for r in ("encoding", "too_large", "corrupt")] == counts
    env.assert_empty()


# -- prompt cache reads and writes -------------------------------------------------------------

CACHE_READ, CACHE_WRITE = 1200, 96
# What each wire says of its cache (the mock's answers, as the providers shape them): Anthropic
# both reads and writes; OpenAI's wires only what they read.
CACHE_SAID = {
    "/v1/messages": (CACHE_READ, CACHE_WRITE),
    "/v1/chat/completions": (CACHE_READ, None),
    "/v1/responses": (CACHE_READ, None),
}


async def mock_answer(path: str, *, stream: bool) -> bytes:
    """The mock provider's answer to the request of `path`, reporting a set cache use."""
    from switchyard_mw.testing import Behaviour

    mock = MockProvider()
    mock.set_behaviour("*", Behaviour(cache_read_tokens=CACHE_READ, cache_write_tokens=CACHE_WRITE))
    asked = {**REQUESTS[path], "stream": True} if stream else REQUESTS[path]
    if stream and path == "/v1/chat/completions":
        asked = {**asked, "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=mock)) as client:
        reply = await client.post(f"http://mock.test{path}", json=asked, headers={"x-api-key": "k"})
    assert reply.status_code == 200
    return reply.content


def cache_grew(
    before: dict[str, tuple[int, float]], after: dict[str, tuple[int, float]]
) -> tuple[float | None, float | None]:
    """What one request added to the cache reads and creations (None: no value recorded)."""

    def added(kind: str) -> float | None:
        count, total = after.get(kind, (0, 0.0))
        was_count, was_total = before.get(kind, (0, 0.0))
        return None if count == was_count else total - was_total

    return added("cache_read"), added("cache_creation")


@pytest.mark.parametrize("streamed", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("path", list(CACHE_SAID))
async def test_cache_reads_and_writes_are_recorded_as_their_token_types(
    env: Env, path: str, streamed: bool
) -> None:
    body = await mock_answer(path, stream=streamed)
    before = tokens()
    headers = SSE if streamed else {"content-type": "application/json"}
    stream, _ = await env.answered(path, 200, headers)
    for i in range(0, len(body), 7):  # events and fields cut across pieces
        await stream.send(response_body(body[i : i + 7]))
    await stream.send(response_body(b"", end=True))
    after = tokens()
    assert cache_grew(before, after) == CACHE_SAID[path]
    inputs, _ = grew(before, after)
    # `input` keeps its meaning: every input token, the cached ones included.
    assert inputs is not None
    assert inputs > CACHE_READ + (CACHE_SAID[path][1] or 0)
    if not streamed:
        said = msgspec.json.decode(body)["usage"]
        whole = {"/v1/messages": all_input(said), "/v1/chat/completions": said.get("prompt_tokens")}
        assert inputs == whole.get(path, said.get("input_tokens"))
    await stream.close()
    env.assert_empty()
