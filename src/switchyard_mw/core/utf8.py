"""Whether bytes are UTF-8, decoding only the blocks that are not ASCII.

`bytes.decode` is the check the wire contract needs (a body that is not UTF-8 gets 400), but
on a body with a single character past ASCII it decodes every byte and builds a str of the
whole body, two or four bytes a character. Most of a long conversation is ASCII (code, tool
output, JSON punctuation): checking block by block, `isascii` (C, a word at a time) passes
those blocks and only the others are decoded.
"""

from __future__ import annotations

BLOCK = 4096
"""Bytes a block holds before its cut (at most three more: see `is_utf8`)."""

_CONTINUATION_FIRST = 0x80
_CONTINUATION_LAST = 0xBF
_MAX_CONTINUATIONS = 3  # the most any UTF-8 character has (a 4-byte one)


def is_utf8(data: bytes) -> bool:
    """True when `data` decodes as UTF-8: the very bytes `data.decode("utf-8")` accepts."""
    if data.isascii():
        return True
    end = len(data)
    start = 0
    while start < end:
        stop = _cut(data, start + BLOCK, end)
        if stop < 0:
            return False
        block = data[start:stop]
        if not block.isascii():
            try:
                block.decode()
            except UnicodeDecodeError:
                return False
        start = stop
    return True


def _cut(data: bytes, stop: int, end: int) -> int:
    """Where the block ending near `stop` ends: before a byte that is not a continuation byte.

    Such a byte starts a character in valid UTF-8, so a valid sequence is never split and
    validity is the same block by block as for the whole. More than three continuation bytes
    in a row fit no character: -1, the bytes are not UTF-8 (and a run of them is not walked
    byte by byte here).
    """
    for _ in range(_MAX_CONTINUATIONS + 1):
        if stop >= end or not _CONTINUATION_FIRST <= data[stop] <= _CONTINUATION_LAST:
            return min(stop, end)
        stop += 1
    return -1
