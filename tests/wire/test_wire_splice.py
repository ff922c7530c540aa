"""`rewrite_model` splices the top-level `model` value into the body's own bytes.

Decoding the top level and encoding it again is a second full parse and a second copy of a
body that may be megabytes long; a splice costs one copy. What a splice must get right: only
the top-level key (never `model` inside a tool input, metadata or a string), every spelling of
JSON (whitespace, escapes, key order, duplicate keys), and the same decoded object as
decode + set + encode would give. A body with a duplicate `model` key is not spliced: it
is decoded and encoded, which leaves one key, so an upstream that keeps the first of two keys
cannot be handed a model the client chose and switchyard never routed.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from switchyard_mw.wire import Wire, read_request, rewrite_model


def old_rewrite(raw: bytes, model: str) -> Any:
    """What decode + set + encode gives, decoded: the object every splice must decode to."""
    top = msgspec.json.decode(raw)
    top["model"] = model
    return msgspec.json.decode(msgspec.json.encode(top))


def spliced(raw: bytes, old: bytes, new: bytes) -> bytes:
    """`raw` with its only occurrence of `old` replaced by `new` (a test's expected bytes)."""
    assert raw.count(old) == 1, raw
    return raw.replace(old, new)


def test_the_model_value_is_replaced_and_every_other_byte_kept() -> None:
    raw = b'{\n  "messages" : [ {"role":"user","content":"hi"} ],\n'
    raw += b'  "model" :  "a" ,\n  "x": 1.50e2\n}\n'
    assert rewrite_model(raw, "b") == spliced(raw, b'"a"', b'"b"')


def test_a_model_first_last_or_alone() -> None:
    for raw in (
        b'{"model":"a","messages":[]}',
        b'{"messages":[],"model":"a"}',
        b'{"model":"a"}',
        b'  {  "model"\t:\r\n"a"  }  ',
    ):
        assert rewrite_model(raw, "bb") == spliced(raw, b'"a"', b'"bb"'), raw


def test_nested_model_keys_are_untouched() -> None:
    raw = json.dumps(
        {
            "metadata": {"model": "meta"},
            "messages": [
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t", "input": {"model": "tool"}}],
                },
                {"role": "user", "content": [{"type": "tool_result", "content": {"model": 1}}]},
            ],
            "model": "a",
            "tools": [{"name": "pick", "input_schema": {"properties": {"model": {}}}}],
        }
    ).encode()
    out = rewrite_model(raw, "b")
    # nested keys before the top-level one: not proven apart by bytes, so decoded and encoded
    assert msgspec.json.decode(out) == old_rewrite(raw, "b")
    assert out.count(b'"model":"b"') == 1


def test_nested_model_keys_only_after_the_top_level_key_are_spliced() -> None:
    raw = b'{"messages":[],"model":"a","tools":[{"input_schema":{"properties":{"model":{}}}}]}'
    assert rewrite_model(raw, "b") == spliced(raw, b'"a"', b'"b"')


def test_nested_model_keys_that_open_their_object_are_untouched() -> None:
    raw = b'{"a":{"model":"x"},"b":[{"model":"y"}],"model":"m","c":{"model":"z"}}'
    assert rewrite_model(raw, "n") == spliced(raw, b'"m"', b'"n"')


def test_model_spelled_inside_strings_is_untouched() -> None:
    raw = json.dumps(
        {
            "messages": [{"role": "user", "content": 'set {"model": "x"} and ,"model":"y"}'}],
            "note": "ends in a backslash \\",
            "model": "a",
        }
    ).encode()
    out = rewrite_model(raw, "b")
    assert msgspec.json.decode(out) == old_rewrite(raw, "b")
    assert out == spliced(raw, b'"model": "a"', b'"model": "b"')


def test_a_key_after_a_string_ending_in_a_backslash_is_top_level() -> None:
    raw = b'{"a":"x\\\\","model":"m","b":"y\\\\"}'
    assert rewrite_model(raw, "n") == spliced(raw, b'"m"', b'"n"')


def test_escapes_in_the_old_and_the_new_value() -> None:
    raw = b'{"messages":[],"model":"a\\"b\\\\c\\u00e9","z":0}'
    out = rewrite_model(raw, 'q"\\ \u00e9\u6a21')
    assert msgspec.json.decode(out) == old_rewrite(raw, 'q"\\ \u00e9\u6a21')
    assert out.startswith(b'{"messages":[],"model":"q\\"')
    assert out.endswith(b'","z":0}')


def test_a_top_level_duplicate_leaves_one_model_key() -> None:
    raw = b'{"model":"a","messages":[{"model":"keep"}],"model":"b","x":{"model":"keep"}}'
    assert read_request(Wire.ANTHROPIC, raw).model == "b"
    out = rewrite_model(raw, "c")
    assert out.count(b'"model":"c"') == 1
    assert b'"a"' not in out
    assert b'"b"' not in out
    assert msgspec.json.decode(out) == {
        "model": "c",
        "messages": [{"model": "keep"}],
        "x": {"model": "keep"},
    }


def test_a_nested_model_key_before_the_top_level_one_gives_the_right_answer() -> None:
    raw = b'{"messages":[{"model":"keep"}],"model":"b"}'
    out = rewrite_model(raw, "c")
    assert msgspec.json.decode(out) == {"messages": [{"model": "keep"}], "model": "c"}


def test_a_key_spelled_with_escapes_is_the_same_key() -> None:
    raw = b'{"messages":[],"mod\\u0065l":"a"}'
    assert read_request(Wire.ANTHROPIC, raw).model == "a"  # the reader sees it as `model`
    out = rewrite_model(raw, "b")
    assert msgspec.json.decode(out) == {"messages": [], "model": "b"}
    assert b'"a"' not in out


def test_an_escaped_duplicate_before_the_key_is_removed_too() -> None:
    raw = b'{"mod\\u0065l":"a","messages":[],"model":"b"}'
    out = rewrite_model(raw, "c")
    assert msgspec.json.decode(out) == {"model": "c", "messages": []}
    assert b'"a"' not in out


def test_an_escaped_duplicate_after_the_key_is_rewritten_too() -> None:
    raw = b'{"model":"a","messages":[],"\\u006dodel":"b"}'
    out = rewrite_model(raw, "c")
    assert msgspec.json.decode(out) == {"model": "c", "messages": []}
    assert b'"a"' not in out
    assert b'"b"' not in out


def test_many_nested_model_keys_still_give_the_right_answer() -> None:
    turns = [
        {"role": "user", "content": [{"type": "x", "input": {"model": str(i)}}]} for i in range(40)
    ]
    raw = json.dumps({"messages": turns, "model": "a", "tools": [{"model": "t"}]}).encode()
    out = rewrite_model(raw, "b")
    assert msgspec.json.decode(out) == old_rewrite(raw, "b")


def test_a_deep_body_is_spliced_without_running_out_of_stack() -> None:
    deep = "[" * 900 + "]" * 900
    raw = f'{{"messages":[{{"role":"user","content":{deep}}}],"model":"m","x":{deep}}}'.encode()
    assert rewrite_model(raw, "n") == spliced(raw, b'"m"', b'"n"')


# --- the property: a splice decodes to what decode + set + encode decodes to ---------------

_KEYS = st.sampled_from(["model", "messages", "role", "content", "input", "x", "mod", "modelx"])
_TEXT = st.text(alphabet=st.sampled_from('abm\u00e9\u6a21"\\,:{}[] \n\u2028'), max_size=12)
_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-10, 10)
    | st.floats(allow_nan=False, allow_infinity=False)
    | _TEXT
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_KEYS | _TEXT, inner, max_size=4),
    max_leaves=20,
)
_MODELS = st.text(alphabet=st.sampled_from('ab-.9 \u00e9\u6a21"\\'), min_size=1, max_size=10)


def _dumps(obj: dict[str, Any], style: int) -> bytes:
    if style == 0:
        return json.dumps(obj, separators=(",", ":")).encode()
    if style == 1:
        return json.dumps(obj, ensure_ascii=False, indent=2).encode()
    return json.dumps(obj, ensure_ascii=False, separators=(" , ", " :\t")).encode()


@settings(max_examples=400, deadline=None)
@given(
    others=st.dictionaries(_KEYS | _TEXT, _VALUES, max_size=6),
    model=_MODELS,
    new=_MODELS,
    at=st.integers(0, 6),
    style=st.integers(0, 2),
)
def test_a_splice_decodes_to_decode_set_encode(
    others: dict[str, Any], model: str, new: str, at: int, style: int
) -> None:
    items = [(k, v) for k, v in others.items() if k != "model"]
    items.insert(min(at, len(items)), ("model", model))
    raw = _dumps(dict(items), style)
    out = rewrite_model(raw, new)
    assert msgspec.json.decode(out) == old_rewrite(raw, new)


@settings(max_examples=200, deadline=None)
@given(
    before=st.dictionaries(_KEYS, _VALUES, max_size=3),
    after=st.dictionaries(_KEYS, _VALUES, max_size=3),
    first=_MODELS,
    second=_MODELS,
    new=_MODELS,
)
def test_duplicates_decode_to_the_new_model(
    before: dict[str, Any], after: dict[str, Any], first: str, second: str, new: str
) -> None:
    def members(d: dict[str, Any]) -> list[str]:
        return [f"{json.dumps(k)}:{json.dumps(v)}" for k, v in d.items() if k != "model"]

    parts = [*members(before), f'"model":{json.dumps(first)}', *members(after)]
    parts.append(f'"model":{json.dumps(second)}')
    raw = ("{" + ",".join(parts) + "}").encode()
    out = rewrite_model(raw, new)
    assert msgspec.json.decode(out) == old_rewrite(raw, new)
    assert json.loads(out)["model"] == new
    # one key left: a reader that keeps the first of two keys sees the new model too
    top = json.loads(out, object_pairs_hook=list)
    assert [v for k, v in top if k == "model"] == [new]
