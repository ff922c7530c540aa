"""`core.utf8.is_utf8` accepts exactly the bytes `bytes.decode("utf-8")` accepts.

It decodes only the blocks that are not ASCII, cutting blocks before a byte that starts a
character, so the cases that matter sit at block edges: a sequence split by a cut, a bad one
just before or after it, a body exactly one block long.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from switchyard_mw.core import utf8
from switchyard_mw.core.utf8 import is_utf8

BLOCK = utf8.BLOCK


def decodes(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


# Pieces a body is made of: ASCII runs, valid characters of every length, and every kind of
# byte sequence the UTF-8 decoder must refuse.
_BAD = [
    b"\xed\xa0\x80",  # a surrogate (U+D800) encoded as UTF-8
    b"\xed\xbf\xbf",  # U+DFFF
    b"\xc0\xaf",  # overlong '/'
    b"\xc1\xbf",
    b"\xe0\x80\xaf",  # overlong, three bytes
    b"\xf0\x80\x80\xaf",  # overlong, four bytes
    b"\xf4\x90\x80\x80",  # past U+10FFFF
    b"\xf8\x88\x80\x80\x80",  # a 5-byte lead
    b"\xfc\x84\x80\x80\x80\x80",  # a 6-byte lead
    b"\xfe",
    b"\xff",
    b"\x80",  # stray continuation bytes
    b"\xbf\xbf\xbf\xbf\xbf",
    b"\xe2\x98",  # truncated sequences
    b"\xf0\x9f\x98",
    b"\xc3",
]
_GOOD = ["é", "—", "☕", "日本語", "😀", "\U0010ffff", "\u07ff", "\u0800", "\ud7ff", "\ue000"]

_pieces = st.one_of(
    st.binary(max_size=40).map(lambda b: bytes(c & 0x7F for c in b)),  # ASCII
    st.sampled_from(_GOOD).map(str.encode),
    st.text(max_size=20).map(lambda s: s.encode("utf-8", "surrogatepass")),
    st.sampled_from(_BAD),
    st.binary(max_size=6),
)


def _near_edges(pieces: list[bytes], pad: int) -> bytes:
    # ASCII padding moves the pieces across block edges without changing their validity.
    return b"a" * pad + b"".join(pieces)


@settings(max_examples=600, deadline=None)
@given(
    st.lists(_pieces, max_size=30),
    st.sampled_from([0, 1, BLOCK - 7, BLOCK - 3, BLOCK - 2, BLOCK - 1, BLOCK, 2 * BLOCK - 1]),
)
@example([b"\xed\xa0\x80"], BLOCK - 1)
@example([b"\xe2\x98\x95"], BLOCK - 2)
@example([b"\xbf\xbf\xbf\xbf"], BLOCK)
def test_is_utf8_agrees_with_the_decoder(pieces: list[bytes], pad: int) -> None:
    data = _near_edges(pieces, pad)
    assert is_utf8(data) is decodes(data)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=3 * BLOCK))
def test_is_utf8_agrees_on_any_bytes(data: bytes) -> None:
    assert is_utf8(data) is decodes(data)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, BLOCK + 8), st.lists(_pieces, max_size=3)),
        min_size=1,
        max_size=3 * utf8.DENSE,
    )
)
def test_is_utf8_agrees_over_many_blocks(blocks: list[tuple[int, list[bytes]]]) -> None:
    # ASCII stretches of about a block between the pieces: runs of blocks that are not ASCII
    # (decoded in one call), ASCII blocks between them, and runs long enough to be dense.
    data = b"".join(b"a" * pad + b"".join(pieces) for pad, pieces in blocks)
    assert is_utf8(data) is decodes(data)


@pytest.mark.parametrize("bad_block", [0, 1, utf8.DENSE - 1, utf8.DENSE, 3 * utf8.DENSE - 1])
@pytest.mark.parametrize("ascii_every", [0, 2, 3])
def test_a_bad_sequence_in_any_block_of_a_long_body(bad_block: int, ascii_every: int) -> None:
    blocks = []
    for i in range(3 * utf8.DENSE):
        text = b"x" * (BLOCK - 10)
        if not ascii_every or i % ascii_every:
            text += "日本".encode()  # this block is not ASCII
        if i == bad_block:
            text += b"\xed\xa0\x80"
        blocks.append(text)
    data = b"".join(blocks)
    assert is_utf8(data) is decodes(data) is False
    assert is_utf8(data.replace(b"\xed\xa0\x80", b"ok!"))


def _at(offset: int, seq: bytes, size: int = 3 * BLOCK) -> bytes:
    body = bytearray(b"x" * size)
    body[offset : offset + len(seq)] = seq
    return bytes(body)


@pytest.mark.parametrize("shift", range(-5, 3))
@pytest.mark.parametrize("edge", [BLOCK, 2 * BLOCK])
@pytest.mark.parametrize(
    "seq",
    [
        "é".encode(),
        "☕".encode(),
        "😀".encode(),
        b"\xed\xa0\x80",
        b"\xe2\x98",
        b"\xf0\x9f\x98",
        b"\xc0\xaf",
        b"\x80\x80\x80\x80",
        b"\xf8\x88\x80\x80\x80",
    ],
)
def test_sequences_across_a_block_edge(edge: int, shift: int, seq: bytes) -> None:
    data = _at(edge + shift, seq)
    assert is_utf8(data) is decodes(data)


@pytest.mark.parametrize("size", [BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK])
def test_bodies_at_block_sizes(size: int) -> None:
    good = ("é" * size).encode()[:size]
    assert is_utf8(good) is decodes(good)
    assert is_utf8(b"a" * size)
    bad = b"a" * (size - 1) + b"\xe2"
    assert not is_utf8(bad)


def test_a_long_run_of_continuation_bytes_is_refused_at_once() -> None:
    # Cuts move past continuation bytes, three at most (no character has more): a body of
    # nothing else must not be walked byte by byte in Python.
    data = b"a" * (BLOCK - 1) + b"\x80" * (4 * BLOCK)
    assert not is_utf8(data)


def test_the_empty_body_and_pure_ascii() -> None:
    assert is_utf8(b"")
    assert is_utf8(b'{"model": "m"}' * 1000)
