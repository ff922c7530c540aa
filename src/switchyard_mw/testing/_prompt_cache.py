"""The mock provider's prompt cache: per API key and model, a prompt prefix seen within a TTL
is read from the cache, as providers cache a prompt's prefix per account.

A request's prompt is its `system` (if any) and its turns (`messages`, or a Responses `input`
list). Each prefix of whole turns is remembered by its hash; a later request under the same key
whose first turns hash the same reads that many bytes from the cache (tokens at the mock's 4
bytes a token). Bounded: at most `max_entries` prefixes are kept, the oldest dropped first.
"""

from __future__ import annotations

import collections
import hashlib
import time
from collections.abc import Callable
from typing import Any

import msgspec

_encode = msgspec.json.Encoder(order="deterministic").encode


class PromptCache:
    def __init__(
        self,
        *,
        ttl_secs: float = 300.0,
        max_entries: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_secs = ttl_secs
        self._clock = clock
        self._seen: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self._max = max_entries

    def clear(self) -> None:
        self._seen.clear()

    def read(self, key: str, model: str | None, fields: dict[str, Any]) -> tuple[int, int]:
        """(cached bytes, prompt bytes) of this request; remembers its prefixes from now on."""
        turns = fields.get("messages")
        if not isinstance(turns, list):
            turns = fields.get("input")
        if not isinstance(turns, list) or not turns:
            return 0, 0
        now = self._clock()
        digest = hashlib.blake2b(f"{key}\x00{model}\x00".encode(), digest_size=16)
        system = fields.get("system")
        size = len(_encode(system)) if system is not None else 0
        digest.update(_encode(system))
        cached, unbroken = 0, True
        prefixes = []
        for turn in turns:
            piece = _encode(turn)
            digest.update(piece)
            size += len(piece)
            mark = digest.digest()
            prefixes.append(mark)
            seen = self._seen.get(mark)
            # Only an unbroken prefix (the system prompt with the first turns) is a cache read.
            unbroken = unbroken and seen is not None and now - seen <= self.ttl_secs
            if unbroken:
                cached = size
        for mark in prefixes:
            self._seen[mark] = now
            self._seen.move_to_end(mark)
        while len(self._seen) > self._max:
            self._seen.popitem(last=False)
        return cached, size
