"""Whether bytes are UTF-8, decoding only the stretches that are not ASCII.

`bytes.decode` is the check the wire contract needs (a body that is not UTF-8 gets 400), but
on a body with a single character past ASCII it decodes every byte and builds a str of the
whole body, two or four bytes a character. Much of a long conversation is often ASCII (code,
tool output, JSON punctuation): walking the body in blocks, `isascii` (C, a word at a time)
passes those blocks, and each run of blocks that are not ASCII is decoded in one call.
Decoding block by block costs more than one decode (each block's str starts narrow and is
widened again), so text past ASCII in every block gets one decode from there to the end.
"""

from __future__ import annotations

from codecs import utf_8_decode

BLOCK = 4096
"""Bytes a block holds before its cut (at most three more: see `_cut`)."""

DENSE = 4
"""Blocks in a row that are not ASCII after which the rest is decoded at once."""

_CONTINUATION_FIRST = 0x80
_CONTINUATION_LAST = 0xBF
_MAX_CONTINUATIONS = 3  # the most any UTF-8 character has (a 4-byte one)


def is_utf8(data: bytes) -> bool:
    """True when `data` decodes as UTF-8: the very bytes `data.decode("utf-8")` accepts."""
    if data.isascii():
        return True
    view = memoryview(data)  # decoded through slices of it: no copy of what is decoded
    end = len(data)
    start = 0
    span = -1  # where the current run of blocks that are not ASCII starts (-1: no run)
    run = 0
    while start < end:
        stop = start + BLOCK
        if stop >= end:
            stop = end
        elif _CONTINUATION_FIRST <= data[stop] <= _CONTINUATION_LAST:
            stop = _cut(data, stop, end)  # rare: most cuts land on a byte that starts a character
            if stop < 0:
                return False
        if data[start:stop].isascii():
            if span >= 0 and not _decodes(view[span:start]):
                return False
            span = -1
        else:
            if span < 0:
                span, run = start, 0
            run += 1
            if run == DENSE:
                return _decodes(view[span:])
        start = stop
    return span < 0 or _decodes(view[span:])


def _decodes(data: memoryview) -> bool:
    try:
        utf_8_decode(data, "strict", True)  # final: a truncated last character is an error
    except UnicodeDecodeError:
        return False
    return True


def _cut(data: bytes, stop: int, end: int) -> int:
    """Where the block ending near `stop` ends: before a byte that is not a continuation byte.

    Such a byte starts a character in valid UTF-8, so a cut never splits a valid sequence,
    and bytes are valid as a whole exactly when each stretch between cuts is. More than
    three continuation bytes in a row fit no character: -1, the bytes are not UTF-8 (and a
    long run of them is not walked byte by byte here).
    """
    for _ in range(_MAX_CONTINUATIONS + 1):
        if stop >= end or not _CONTINUATION_FIRST <= data[stop] <= _CONTINUATION_LAST:
            return min(stop, end)
        stop += 1
    return -1
