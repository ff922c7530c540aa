"""What writing the public model name into an answer costs (`answer_names`), in process.

For each wire, a JSON answer and an event stream of about 1 KB and 100 KB, shaped as the
providers send them (Chat Completions names the model in every chunk, Messages in
`message_start`, Responses in its `response.*` events, the last of which repeats the whole
answer). A stream is fed one event per piece (as the forwarder relays it, and as Envoy passes
a provider's writes on) and in 4 KiB pieces cut anywhere. Beside it, what reading the same
answer's usage costs (`engine.usage`), the pass both fronts already make. Printed: microseconds
per answer, the median of `--repeat` timings of `--number` answers each.

    python bench/answer_names.py [--repeat 15] [--number 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import timeit
from collections.abc import Callable
from functools import partial

from switchyard_mw.answer_names import StreamNamer, answer_with_model
from switchyard_mw.engine.usage import StreamUsage, answer_tokens
from switchyard_mw.wire import Wire

PROVIDER = "vendor.claude-opus-5-v1:0"
PUBLIC = "claude-opus-5"


def _dump(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def json_answer(wire: Wire, size: int) -> bytes:
    text = "word " * (size // 5)
    usage = {"input_tokens": 10, "output_tokens": 20}
    body: dict[str, object]
    if wire is Wire.ANTHROPIC:
        body = {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": PROVIDER,
            "content": [{"type": "text", "text": text}],
            "stop_reason": "end_turn",
            "usage": usage,
        }
    elif wire is Wire.OPENAI_CHAT:
        body = {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 1,
            "model": PROVIDER,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 10, "completion_tokens": 20},
        }
    else:
        body = _response(text)
    return _dump(body)


def _response(text: str) -> dict[str, object]:
    return {
        "id": "resp_1",
        "object": "response",
        "created_at": 1,
        "status": "completed",
        "instructions": None,
        "model": PROVIDER,
        "output": [
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": text}],
            }
        ],
        "usage": {"input_tokens": 10, "output_tokens": 20},
    }


def stream_events(wire: Wire, size: int) -> list[bytes]:
    """About `size` bytes of events, 4-token deltas (as providers send them)."""
    events: list[bytes] = []
    delta = "word word word word "
    if wire is Wire.ANTHROPIC:
        start = {
            "type": "message_start",
            "message": {
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "model": PROVIDER,
                "content": [],
                "usage": {"input_tokens": 10, "output_tokens": 1},
            },
        }
        events.append(b"event: message_start\ndata: " + _dump(start) + b"\n\n")
        while sum(map(len, events)) < size:
            event = {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": delta},
            }
            events.append(b"event: content_block_delta\ndata: " + _dump(event) + b"\n\n")
        end = {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn"},
            "usage": {"output_tokens": 20},
        }
        events.append(b"event: message_delta\ndata: " + _dump(end) + b"\n\n")
    elif wire is Wire.OPENAI_CHAT:
        while sum(map(len, events)) < size:
            chunk = {
                "id": "chatcmpl-1",
                "object": "chat.completion.chunk",
                "created": 1,
                "model": PROVIDER,
                "choices": [{"index": 0, "delta": {"content": delta}}],
            }
            events.append(b"data: " + _dump(chunk) + b"\n\n")
        events.append(b"data: [DONE]\n\n")
    else:
        created = {
            "type": "response.created",
            "sequence_number": 0,
            "response": {**_response(""), "status": "in_progress", "output": []},
        }
        events.append(b"event: response.created\ndata: " + _dump(created) + b"\n\n")
        text = ""
        while sum(map(len, events)) < size // 2:
            text += delta
            event = {
                "type": "response.output_text.delta",
                "sequence_number": len(events),
                "item_id": "msg_1",
                "output_index": 0,
                "content_index": 0,
                "delta": delta,
            }
            events.append(b"event: response.output_text.delta\ndata: " + _dump(event) + b"\n\n")
        done = {
            "type": "response.completed",
            "sequence_number": len(events),
            "response": _response(text),
        }
        events.append(b"event: response.completed\ndata: " + _dump(done) + b"\n\n")
    return events


def _pieces(events: list[bytes], size: int) -> list[bytes]:
    whole = b"".join(events)
    return [whole[i : i + size] for i in range(0, len(whole), size)]


def _rename(pieces: list[bytes]) -> Callable[[], object]:
    def run() -> object:
        namer = StreamNamer(PUBLIC)
        for piece in pieces:
            namer.feed(piece)
        return namer.end()

    return run


def _usage(wire: Wire, pieces: list[bytes]) -> Callable[[], object]:
    def run() -> object:
        reader = StreamUsage(wire)
        for piece in pieces:
            reader.feed(piece)
        return reader.end()

    return run


def _median_us(run: Callable[[], object], repeat: int, number: int) -> float:
    # CPU time of this process: on a shared machine wall time counts the other processes too.
    timings = timeit.repeat(run, repeat=repeat, number=number, timer=time.process_time)
    return statistics.median(timings) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--number", type=int, default=200)
    args = parser.parse_args()
    rows = []
    for size, label in ((1 << 10, "1 KB"), (100 << 10, "100 KB")):
        for wire in (Wire.ANTHROPIC, Wire.OPENAI_CHAT, Wire.OPENAI_RESPONSES):
            body = json_answer(wire, size)
            rename = _median_us(partial(answer_with_model, body, PUBLIC), args.repeat, args.number)
            usage = _median_us(partial(answer_tokens, wire, body), args.repeat, args.number)
            rows.append((label, wire.name, "JSON", len(body), 1, rename, usage))
            events = stream_events(wire, size)
            for cut, pieces in (("event", events), ("4 KiB", _pieces(events, 4096))):
                stream = _median_us(_rename(pieces), args.repeat, args.number)
                usage = _median_us(_usage(wire, pieces), args.repeat, args.number)
                total = sum(map(len, pieces))
                rows.append(
                    (label, wire.name, f"stream, {cut} pieces", total, len(pieces), stream, usage)
                )
    print("| answer | wire | shape | bytes | pieces | rename (µs) | usage read (µs) |")
    print("|---|---|---|---:|---:|---:|---:|")
    for label, wire_name, shape, total, count, rename_us, usage_us in rows:
        cells = (label, wire_name, shape, f"{total:,}", count, f"{rename_us:.1f}")
        print("| " + " | ".join(map(str, (*cells, f"{usage_us:.1f}"))) + " |")


if __name__ == "__main__":
    main()
