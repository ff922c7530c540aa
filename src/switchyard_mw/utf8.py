"""The one UTF-8 check of a request body (JSON is UTF-8: RFC 8259).

msgspec skips the fields a wire does not read without checking their UTF-8, so a non-ASCII
body is checked once more, over all its bytes: at 1 MB the costliest part of reading a
request. With pysimdjson installed (the `gateway` and `envoy` extras bring it), simdjson's
parse checks it: it validates the whole input's UTF-8 with vector instructions, two to three
times faster than Python's decoder here (docs/performance.md, "The UTF-8 check by
simdjson").

Python's decoder stays the judge: whatever simdjson refuses (a body that is not UTF-8, but
also a document it does not read: nested deeper than 1,024, a number wider than 64 bits, a
lone surrogate escape, a body larger than `SIMD_MAX_BYTES`) is decoded, so every body gets
the decoder's verdict, the one it got without pysimdjson.
"""

from __future__ import annotations

import codecs
import functools
import threading
from collections.abc import Callable
from typing import Any

SIMD_MAX_BYTES = 4 << 20
"""The largest body simdjson checks. Its parser keeps the buffers of the largest document it
read (about three bytes for each of the body's), one parser per thread: this bounds them."""

_DECODE_BLOCK = 65536
_utf8_decode = codecs.utf_8_decode
_local = threading.local()  # simdjson's parser is not thread-safe: one per thread


def check_utf8(body: bytes) -> None:
    """Raise `UnicodeDecodeError` unless `body` is UTF-8."""
    if len(body) > SIMD_MAX_BYTES or not _simd_reads(body):
        _decoder_check(body)


def simd_parser() -> Any:
    """This thread's simdjson parser, or None without pysimdjson.

    A parser is not thread-safe, and it refuses to parse again while a proxy of its last
    document lives: a caller drops every proxy before it returns, as `_simd_reads` does.
    """
    try:
        return _local.parser
    except AttributeError:
        parser = _local.parser = _new_parser()
        return parser


def _simd_reads(body: bytes) -> bool:
    parser = simd_parser()
    if parser is None:
        return False
    try:
        parser.parse(body)  # the document's proxy is dropped at once: the parser is free again
    except (ValueError, RuntimeError):  # UnicodeDecodeError is a ValueError
        return False
    return True


def _parser_factory() -> Callable[[], Any] | None:
    try:
        from simdjson import Parser
    except ImportError:  # the base install: Python's decoder alone
        return None
    return functools.partial(Parser, max_capacity=SIMD_MAX_BYTES)


_PARSER = _parser_factory()  # imported with the package's reading of bodies, not per request


def _new_parser() -> Any:
    return None if _PARSER is None else _PARSER()


def _decoder_check(body: bytes) -> None:
    """Python's decoder, holding no more than 64 KiB of text.

    Decoding a large body whole builds a `str` of up to four times its size only to drop it:
    past malloc's mmap threshold that is fresh pages from the kernel on every request (about
    half the check's CPU at 1 MB, in system time that an instruction count does not show). In
    blocks of 64 KiB the text stays in reused memory and the cache; a character cut by a
    block's edge is read with the next block.
    """
    if len(body) <= _DECODE_BLOCK:
        body.decode()
        return
    whole, size, start = memoryview(body), len(body), 0  # slices of a view are not copies
    while start < size:
        end = start + _DECODE_BLOCK
        # A character cut by the block's edge is left unread (`consumed` stops before it)
        # and read again at the start of the next block: the codecs module's incremental
        # decoder would instead join it to the next block, a copy of each block.
        _, consumed = _utf8_decode(whole[start:end], None, end >= size)
        start += consumed
