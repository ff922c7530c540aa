"""The AWS event-stream decoder (`switchyard_mw.core.eventstream`) beside botocore's parser.

A Bedrock stream is many small frames (one Anthropic event each, base64 in a small JSON
object); a large one is rare but possible. Both decoders are fed the same bytes in the same
pieces; printed: milliseconds per case, best of `--runs`.

    python bench/eventstream.py [--runs 5]
"""

from __future__ import annotations

import argparse
import base64
import json
import time
from collections.abc import Callable

from botocore.eventstream import EventStreamBuffer

from switchyard_mw.core.eventstream import Decoder, encode

HEADERS = {":event-type": "chunk", ":content-type": "application/json", ":message-type": "event"}


def _delta_frame() -> bytes:
    delta = {"type": "text_delta", "text": "hello world " * 3}
    event = json.dumps({"type": "content_block_delta", "index": 0, "delta": delta}).encode()
    return encode(HEADERS, json.dumps({"bytes": base64.b64encode(event).decode()}).encode())


def _ours(pieces: list[bytes]) -> int:
    decoder = Decoder()
    return sum(len(decoder.feed(piece)) for piece in pieces)


def _botocore(pieces: list[bytes]) -> int:
    buffer = EventStreamBuffer()
    count = 0
    for piece in pieces:
        buffer.add_data(piece)
        count += sum(1 for _ in buffer)
    return count


def _best(decode: Callable[[list[bytes]], int], pieces: list[bytes], runs: int) -> float:
    best = float("inf")
    for _ in range(runs):
        started = time.perf_counter()
        decode(pieces)
        best = min(best, time.perf_counter() - started)
    return best * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    runs = parser.parse_args().runs
    frame = _delta_frame()
    cases = {
        f"2,000 {len(frame)}-byte frames in 4 KiB pieces": (frame * 2000, 4096),
        f"2,000 {len(frame)}-byte frames in 64-byte pieces": (frame * 2000, 64),
        "one 4 MiB frame in 16 KiB pieces": (encode(HEADERS, b"x" * (4 << 20)), 16384),
    }
    for name, (data, size) in cases.items():
        pieces = [data[i : i + size] for i in range(0, len(data), size)]
        assert _ours(pieces) == _botocore(pieces)
        ours, theirs = _best(_ours, pieces, runs), _best(_botocore, pieces, runs)
        print(f"{name:45} ours {ours:7.1f} ms   botocore {theirs:7.1f} ms")


if __name__ == "__main__":
    main()
