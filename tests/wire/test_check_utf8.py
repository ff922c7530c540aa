"""Python's decoder in `utf8.check_utf8`, the one UTF-8 check of a request body: in 64 KiB
blocks past that size, it answers as decoding the body whole does, wherever a block's edge
cuts a character. (These bodies are not JSON, so simdjson, when installed, refuses them all
and the decoder answers: tests/wire/test_utf8_simd.py.)"""

from __future__ import annotations

import pytest

from switchyard_mw.utf8 import _DECODE_BLOCK as _UTF8_BLOCK
from switchyard_mw.utf8 import check_utf8

CHARS = ["é", "€", "😀"]  # two, three and four bytes


def whole_says(body: bytes) -> bool:
    try:
        body.decode()
    except UnicodeDecodeError:
        return False
    return True


def check_says(body: bytes) -> bool:
    try:
        check_utf8(body)
    except UnicodeDecodeError:
        return False
    return True


@pytest.mark.parametrize("char", CHARS)
@pytest.mark.parametrize("shift", range(4))
def test_a_character_cut_by_a_blocks_edge_is_carried_over(char: str, shift: int) -> None:
    # The character starts `shift` bytes before the edge of the first, second and third block.
    for blocks in (1, 2, 3):
        body = b"a" * (blocks * _UTF8_BLOCK - shift) + char.encode() + b"z" * 10
        assert check_says(body)
        assert whole_says(body)


@pytest.mark.parametrize(
    "tail",
    [
        b"\xff",  # never UTF-8
        b"\xc3",  # a character cut at the end of the body
        b"\xf0\x9f\x98",  # the same, three bytes of four
        b"\xc0\xaf",  # overlong
        b"\xed\xa0\x80",  # a surrogate
        b"\xe2\x82",  # cut, then more text
    ],
)
@pytest.mark.parametrize("at", [10, _UTF8_BLOCK - 1, _UTF8_BLOCK, 2 * _UTF8_BLOCK + 7, None])
def test_what_is_not_utf8_is_refused_wherever_it_stands(tail: bytes, at: int | None) -> None:
    size = 3 * _UTF8_BLOCK
    body = b"a" * size if at is None else b"a" * at + tail + b"b" * (size - at)
    if at is None:
        body += tail  # at the very end
    assert not whole_says(body)
    assert not check_says(body)


def test_a_large_valid_body_of_every_width_passes() -> None:
    body = ("".join(CHARS) * 40_000).encode()
    assert len(body) > 5 * _UTF8_BLOCK
    assert check_says(body)
