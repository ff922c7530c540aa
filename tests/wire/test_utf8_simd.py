"""The request body's UTF-8 check when pysimdjson is installed (the `gateway` and `envoy`
extras bring it): simdjson's parse answers for the bodies it reads, and whatever it refuses
is decided by Python's decoder, so the verdict is the decoder's for every body."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_check_utf8 import check_says, whole_says  # the verdicts, as that file reads them

from switchyard_mw import utf8
from switchyard_mw.wire import Wire, WireError, read_request

pytest.importorskip("simdjson")

BAD = [
    b"\xff",  # never UTF-8
    b"\xc3",  # a character cut short
    b"\xf0\x9f\x98",  # three bytes of four
    b"\xc0\xaf",  # overlong
    b"\xed\xa0\x80",  # a surrogate
    b"\xf4\x90\x80\x80",  # above U+10FFFF
]


@pytest.fixture
def decodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the bodies handed to Python's decoder (the fallback)."""
    sizes: list[int] = []
    decode = utf8._decoder_check

    def counted(body: bytes) -> None:
        sizes.append(len(body))
        decode(body)

    monkeypatch.setattr(utf8, "_decoder_check", counted)
    return sizes


def conversation(size: int) -> bytes:
    turn = '{"role":"user","content":"Ça marche, 日本語のテキスト 😀 und weiter"},'
    turns = turn * (size // len(turn.encode()) + 1)
    return ('{"model":"m","messages":[' + turns + '{"role":"user","content":"ok"}]}').encode()


@pytest.mark.parametrize("size", [200, 40_000, 300_000, 2_000_000])
def test_a_json_body_simdjson_reads_is_not_decoded_again(size: int, decodes: list[int]) -> None:
    body = conversation(size)
    assert check_says(body)
    assert decodes == []


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("at", ["start", "middle", "end"])
def test_what_is_not_utf8_is_refused_by_both(bad: bytes, at: str, decodes: list[int]) -> None:
    text = "texte é " * 20_000
    where = {"start": 0, "middle": len(text) // 2, "end": len(text)}[at]
    body = b'{"a":"' + text[:where].encode() + bad + text[where:].encode() + b'"}'
    assert not whole_says(body)
    assert not check_says(body)
    assert decodes == [len(body)]  # simdjson refused it; the decoder gave the verdict


@pytest.mark.parametrize(
    "body",
    [
        b'{"a":"\xc3\xa9","deep":' + b"[" * 2_000 + b"]" * 2_000 + b"}",  # deeper than 1,024
        b'{"a":"\xc3\xa9","n":123456789012345678901234567890}',  # wider than 64 bits
        b'{"a":"\xc3\xa9","n":1e999}',  # a number simdjson will not round
        b'{"a":"\xc3\xa9 \\ud800"}',  # a lone surrogate, escaped: ASCII bytes
        b'"\xc3\xa9" trailing',  # not JSON at all: the check is of the bytes, not the syntax
    ],
)
def test_a_valid_body_simdjson_refuses_is_decided_by_the_decoder(
    body: bytes, decodes: list[int]
) -> None:
    assert check_says(body)
    assert decodes == [len(body)]


def test_a_body_above_the_parsers_capacity_goes_to_the_decoder(decodes: list[int]) -> None:
    body = conversation(utf8.SIMD_MAX_BYTES + 1)
    assert len(body) > utf8.SIMD_MAX_BYTES
    assert check_says(body)
    bad = body[:-3] + b"\xff" + body[-3:]
    assert not check_says(bad)
    assert decodes == [len(body), len(bad)]


def test_without_pysimdjson_every_body_goes_to_the_decoder(
    monkeypatch: pytest.MonkeyPatch, decodes: list[int]
) -> None:
    monkeypatch.setattr(utf8, "_new_parser", lambda: None)
    monkeypatch.setattr(utf8, "_local", threading.local())
    body = conversation(40_000)
    assert check_says(body)
    assert not check_says(body.replace("日".encode(), b"\xe6\x97", 1))
    assert decodes == [len(body), len(body) - 1]


def test_the_read_refuses_a_body_that_is_not_utf8_in_a_skipped_field() -> None:
    body = conversation(40_000)[:-1] + b',"metadata":{"note":"caf\xc3"}}'
    with pytest.raises(WireError) as raised:
        read_request(Wire.OPENAI_CHAT, body)
    assert "request body is not valid UTF-8" in str(raised.value)
    wide = conversation(40_000)[:-1] + b',"seed":123456789012345678901234567890}'
    assert read_request(Wire.OPENAI_CHAT, wide).model == "m"


def test_threads_checking_at_once_each_get_their_own_answer() -> None:
    good = conversation(100_000)
    bad = good[:50_000] + b"\xff" + good[50_001:]
    wrong: list[str] = []

    def check(body: bytes, expected: bool) -> None:
        for _ in range(40):
            if check_says(body) is not expected:
                wrong.append(f"{len(body)} read as {not expected}")

    threads = [threading.Thread(target=check, args=(b, b is good)) for b in (good, bad) * 3]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=64), st.text(max_size=40))
def test_the_verdict_is_the_decoders_for_any_bytes_in_a_string(raw: bytes, text: str) -> None:
    body = b'{"a":"' + text.encode() + raw.replace(b'"', b"").replace(b"\\", b"") + b'"}'
    assert check_says(body) is whole_says(body)
