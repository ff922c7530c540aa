"""Generated bad input shared by the fuzz tests of both fronts (`asgi/test_fuzz.py`,
`extproc/test_fuzz_extproc.py`): mutated bodies, header values, and the wire of each path."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

PATHS = {
    "/v1/messages": "anthropic",
    "/v1/chat/completions": "openai",
    "/v1/responses": "openai",
}


json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=False),
    st.text(max_size=30),
)
json_value = st.recursive(
    json_leaf,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
fields = st.sampled_from(
    [
        "model",
        "max_tokens",
        "max_completion_tokens",
        "max_output_tokens",
        "stream",
        "messages",
        "metadata",
        "user",
        "input",
        "previous_response_id",
        "safety_identifier",
    ]
)


@st.composite
def mutated_bodies(draw: st.DrawFn) -> bytes:
    base: dict[str, Any] = {
        "model": draw(st.sampled_from(["m", "m2", "other", "auto"])),
        "max_tokens": 10,
        "messages": [{"role": "user", "content": "hi"}],
        "input": "hi",
    }
    for _ in range(draw(st.integers(0, 3))):
        base[draw(fields)] = draw(json_value)
    raw = json.dumps(base).encode()
    kind = draw(st.sampled_from(["keep", "truncate", "splice", "dup", "deep", "giant", "bytes"]))
    if kind == "truncate":
        raw = raw[: draw(st.integers(0, max(0, len(raw) - 1)))]
    elif kind == "splice":
        at = draw(st.integers(0, len(raw)))
        raw = raw[:at] + draw(st.binary(max_size=8)) + raw[at:]
    elif kind == "dup":
        raw = raw[:-1] + b', "model": ' + json.dumps(draw(json_value)).encode() + b"}"
    elif kind == "deep":
        depth = draw(st.integers(10, 3000))
        raw = raw[:-1] + b', "messages": ' + b"[" * depth + b"]" * depth + b"}"
    elif kind == "giant":
        raw = raw[:-1] + b', "pad": "' + b"x" * draw(st.integers(1000, 80_000)) + b'"}'
    elif kind == "bytes":
        raw = draw(st.binary(max_size=64))
    return raw


header_values = st.one_of(
    st.binary(max_size=20),
    st.integers(-(10**20), 10**20).map(lambda n: str(n).encode()),
    st.sampled_from([b"", b"nan", b"inf", b"-0", b"1e309", b" 5 ", b"0x10", b"\xff"]),
)
