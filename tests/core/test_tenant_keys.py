"""Client keys: stored as SHA-256 digests, a presented key found by its digest and confirmed in
constant time, and read from the headers the wires put it in."""

from __future__ import annotations

import hashlib

import pytest

from switchyard_mw.core.tenant_keys import KeyIndex, client_key, digest_entry


def sha(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def test_a_key_finds_its_tenant_by_its_digest() -> None:
    index = KeyIndex({"team-a": [sha("sk-a1"), sha("sk-a2")], "team-b": [sha("sk-b")]})
    assert index.tenant_for("sk-a1") == "team-a"
    assert index.tenant_for("sk-a2") == "team-a"
    assert index.tenant_for("sk-b") == "team-b"
    assert index.tenant_for("sk-c") is None
    assert index.tenant_for("") is None


def test_raw_keys_from_the_environment_are_hashed_at_load() -> None:
    assert digest_entry("sk-raw") == sha("sk-raw")
    assert digest_entry(" sk-raw ") == sha("sk-raw")
    assert digest_entry(sha("x").upper().replace("SHA256:", "sha256:")) == sha("x")


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ("sha256:abc", "64 hexadecimal digits"),
        ("sha256:" + "g" * 64, "64 hexadecimal digits"),
        ("", "empty"),
    ],
)
def test_a_malformed_entry_says_what_is_wrong(entry: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        digest_entry(entry)


def test_one_key_for_two_tenants_is_refused() -> None:
    with pytest.raises(ValueError, match="team-a and team-b"):
        KeyIndex({"team-a": [sha("same")], "team-b": [sha("same")]})


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"x-api-key": "sk-1"}, "sk-1"),
        ({"authorization": "Bearer sk-2"}, "sk-2"),
        ({"authorization": "bearer  sk-3 "}, "sk-3"),
        ({"authorization": "Basic abc"}, None),
        ({"x-api-key": "sk-1", "authorization": "Bearer sk-2"}, "sk-1"),
        ({"x-api-key": ""}, None),
        ({}, None),
    ],
)
def test_the_client_key_comes_from_x_api_key_or_a_bearer_token(
    headers: dict[str, str], expected: str | None
) -> None:
    assert client_key(headers.get) == expected
