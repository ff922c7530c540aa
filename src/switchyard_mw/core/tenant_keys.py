"""Who is asking: client keys stored as SHA-256 digests and matched in constant time.

The config holds no client key in the clear: `keys` are `sha256:<hex>` digests, and keys read
from the environment (`keys_env`) are hashed as they are loaded. A presented key is hashed
(a time that depends on its length, not its bytes) and its digest looked up. No secret is ever
compared byte by byte: the only comparison is of digests, and learning a stored digest by
timing, byte after byte, would still leave its preimage to find. So the match takes the same
time whatever bytes of a real key the client got right, which is what a constant-time
comparison is for, and costs one hash and one dict lookup however many keys there are.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping

PREFIX = "sha256:"
_HEX = frozenset("0123456789abcdef")


def digest_entry(entry: str) -> str:
    """A config entry as `sha256:<hex>`: a digest as written (any case), or a raw key hashed."""
    text = entry.strip()
    if not text:
        raise ValueError("an empty key")
    if text.lower().startswith(PREFIX):
        hexdigest = text[len(PREFIX) :].lower()
        if len(hexdigest) != 64 or not set(hexdigest) <= _HEX:
            raise ValueError("a sha256: entry takes 64 hexadecimal digits")
        return PREFIX + hexdigest
    return PREFIX + hashlib.sha256(text.encode()).hexdigest()


class KeyIndex:
    """Each tenant's key digests, for finding the tenant of a presented key."""

    def __init__(self, keys: Mapping[str, Iterable[str]]) -> None:
        self._by_digest: dict[bytes, str] = {}
        for tenant, entries in keys.items():
            for entry in entries:
                digest = bytes.fromhex(digest_entry(entry)[len(PREFIX) :])
                other = self._by_digest.setdefault(digest, tenant)
                if other != tenant:
                    raise ValueError(f"one key belongs to {other} and {tenant}")

    def tenant_for(self, key: str) -> str | None:
        """The tenant whose keys include `key`, or None."""
        if not key:
            return None
        return self._by_digest.get(hashlib.sha256(key.encode()).digest())

    def __len__(self) -> int:
        return len(self._by_digest)


def client_key(header: Callable[[str], str | None]) -> str | None:
    """The key a client sent, from `x-api-key` (Anthropic's) or `Authorization: Bearer`
    (OpenAI's); `header(name)` reads one request header by its lower-case name."""
    key = (header("x-api-key") or "").strip()
    if key:
        return key
    scheme, _, token = (header("authorization") or "").strip().partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return None
