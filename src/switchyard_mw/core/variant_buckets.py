"""Canary variant selection: a pure function of (salt, model, key, weights).

bucket = blake2b(salt, model, key) mod 10000. The first listed variant owns buckets counted up
from 0, the second owns buckets counted down from 9999, any further ones stack after the first.
With one or two variants, raising a percentage therefore only moves keys out of the base model
into that variant (a monotone ramp); keys already in a variant stay there.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

BUCKETS = 10_000

KeyKind = Literal["user", "first_turn", "none"]


def bucket(salt: str, model: str, key: str) -> int:
    """A stable bucket in [0, 10000) for this key; the same in every process and replica."""
    return _bucket(_prefix(salt, model), key)


def _prefix(salt: str, model: str) -> bytes:
    return salt.encode() + b"\x00" + model.encode() + b"\x00"


def _bucket(prefix: bytes, key: str) -> int:
    # blake2b(salt NUL model NUL key): the prefix is the same for every key of one canary.
    digest = hashlib.blake2b(prefix + key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % BUCKETS


@dataclass(frozen=True, slots=True)
class Split:
    """A canary's bucket ranges, computed once at load. `ranges` are half-open [lo, hi)."""

    base: str
    salt: str
    ranges: tuple[tuple[int, int, str], ...]
    prefix: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefix", _prefix(self.salt, self.base))

    @classmethod
    def build(cls, base: str, variants: Sequence[tuple[str, float]], salt: str = "") -> Split:
        ranges: list[tuple[int, int, str]] = []
        low, high = 0, BUCKETS
        for i, (model, percent) in enumerate(variants):
            width = round(percent * BUCKETS / 100)
            if width <= 0:
                continue
            if i == 1:
                ranges.append((high - width, high, model))
                high -= width
            else:
                ranges.append((low, low + width, model))
                low += width
        return cls(base=base, salt=salt, ranges=tuple(ranges))

    def pick(self, key: str | None) -> str:
        """The model for this key; a request without a key stays on the base model."""
        if key is None or not self.ranges:
            return self.base
        b = _bucket(self.prefix, key)
        for low, high, model in self.ranges:
            if low <= b < high:
                return model
        return self.base

    def choose(self, user_key: str | None, first_turn_hash: str | None) -> tuple[str, KeyKind]:
        """The model for a request, and which key decided it (user id wins over first turn)."""
        if user_key:
            return self.pick(user_key), "user"
        if first_turn_hash:
            return self.pick(first_turn_hash), "first_turn"
        return self.base, "none"
