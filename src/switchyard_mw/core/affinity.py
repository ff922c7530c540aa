"""Conversation-to-account affinity: weighted rendezvous (highest-random-weight) hashing.

Providers cache a prompt's prefix per account; a conversation whose turns land on one account
reads its prefix from that cache. Each account gets a score per conversation key,
``-weight / ln(u)`` with ``u`` a uniform number in (0, 1) drawn from (key, account); the
accounts in decreasing score order are the key's rendezvous order, and the first usable one
serves. An account's share of keys is then its weight's share (the weighted rendezvous of
Schindelhauer and Schomaker), and when one account leaves only the keys it ranked first move,
each to its own next account; they move back when it returns.

Pure and stateless: the same key, names and weights give the same order in every process.
The key is hashed once per request (:func:`key_hash`); each account's part is a fixed 64-bit
seed mixed in with a few integer operations (:func:`seed`, :func:`score`), not another hash.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

_MASK = (1 << 64) - 1
_TWO_64 = float(1 << 64)


def key_hash(key: str) -> int:
    """The conversation key as a 64-bit integer (blake2b), the same in every process."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


def seed(account: str) -> int:
    """An account's fixed 64-bit part of every score, computed once per account."""
    digest = hashlib.blake2b(account.encode(), digest_size=8, person=b"affinity").digest()
    return int.from_bytes(digest, "big")


def _mix(x: int) -> int:
    # splitmix64's finaliser: every output bit depends on every input bit, so the numbers of
    # one key against different seeds are independent enough for the shares to follow weights.
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def score(key: int, account_seed: int, weight: float) -> float:
    """The account's rendezvous score for the key: ``-weight / ln(u)``, u uniform in (0, 1)."""
    u = (_mix(key ^ account_seed) + 0.5) / _TWO_64  # never 0 nor 1: ln(u) < 0
    return -weight / math.log(u)


def order(key: int, seeds: Sequence[int], weights: Sequence[float]) -> list[int]:
    """Indices of the accounts in the key's rendezvous order (best first).

    Ties (equal scores: practically never) fall to the lower index, so the order is total.
    """
    scores = [score(key, s, w) for s, w in zip(seeds, weights, strict=True)]
    return sorted(range(len(scores)), key=lambda i: (-scores[i], i))


def pick(key: str, accounts: Sequence[tuple[str, float]]) -> list[str]:
    """The account names of ``accounts`` (name, weight) in ``key``'s rendezvous order.

    The convenient form for tables and tools; the pool keeps seeds precomputed instead.
    """
    k = key_hash(key)
    idx = order(k, [seed(name) for name, _ in accounts], [w for _, w in accounts])
    return [accounts[i][0] for i in idx]
