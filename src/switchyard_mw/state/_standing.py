"""Throttle holds and canary-guard trips kept in Redis with their expiry, so that a replica that
starts or reconnects later applies every one in force; pub/sub carries them to the replicas
already listening, as fast as before.

``P:holds:{A}`` (``A`` = account): a sorted set, member = model, score = when the hold ends in
ms of Redis's clock (``TIME``, as for cooling: no host's wall clock is trusted across hosts).
Every write first drops the holds that ended, then keeps the longer of two holds (a hold never
shortens), and sets the key's TTL to its longest hold: a key no 429 renews is gone when its last
hold ends. At most :data:`~switchyard_mw.core.pool.MAX_HOLDS` models per account, as each pool
keeps (a wildcard account is held per model string a client sent). The braces put it in the
slot of the account's other keys.

``P:trips``: a hash, field = ``["base", "variant"]`` (JSON), value = the canary's signature
(its split and guard as configured): a stored trip applies only where that canary is configured
the same. One field per tripped variant; a reload deletes the key (each reload starts the
guards afresh). Bounded by the canaries configured, whatever the traffic.

Both scripts publish a note (JSON, ``{"t": ...}``) for each entry they change, and only then,
so that a resync putting back what Redis already had sends nothing.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from ..core.pool import MAX_HOLDS
from ._lua import Script
from ._redis_io import Call

HOLDS = Script("""
local key, channel, cap = KEYS[1], ARGV[1], tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
for i = 4, #ARGV, 3 do
  local model, untl = ARGV[i], now + tonumber(ARGV[i + 1])
  local current = tonumber(redis.call('ZSCORE', key, model))
  if (current and untl > current) or (not current and redis.call('ZCARD', key) < cap) then
    redis.call('ZADD', key, string.format('%d', untl), model)
    redis.call('PUBLISH', channel, ARGV[i + 2])
  end
end
local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
if last[2] then
  redis.call('PEXPIRE', key, string.format('%d', tonumber(last[2]) - now))
end
local out = {}
if ARGV[3] == '1' then
  local all = redis.call('ZRANGE', key, 0, -1, 'WITHSCORES')
  for i = 1, #all, 2 do
    out[#out + 1] = all[i]
    out[#out + 1] = string.format('%d', tonumber(all[i + 1]) - now)
  end
end
return out
""")
"""KEYS: the account's holds. ARGV: channel, cap, read ("1": reply with every hold in force as
model, ms left, ...), then model, ms left, note for each hold to keep."""

TRIPS = Script("""
local key, channel = KEYS[1], ARGV[2]
if ARGV[1] == 'clear' then
  redis.call('DEL', key)
  return {}
end
for i = 3, #ARGV, 3 do
  if redis.call('HGET', key, ARGV[i]) ~= ARGV[i + 1] then
    redis.call('HSET', key, ARGV[i], ARGV[i + 1])
    redis.call('PUBLISH', channel, ARGV[i + 2])
  end
end
return redis.call('HGETALL', key)
""")
"""KEYS: the trips hash. ARGV: "clear" (delete them all) or "put", channel, then field,
signature, note for each trip to keep. Replies (put) with every trip kept: field, signature, ..."""


HOLDS_PER_CALL = 500
"""The most holds one script run keeps (a burst of 429s on a wildcard account is many)."""


class Pending:
    """Holds and trips waiting to be written, coalesced: a burst of 429s costs one script run
    per account, not one per hold. Holds wait with their end in Unix time, so that what is left
    of them is reckoned when they are written."""

    def __init__(self) -> None:
        self._holds: dict[str, dict[str, float]] = {}  # account -> model -> end (Unix)
        self._trips: dict[tuple[str, str], str] = {}  # (base, variant) -> signature
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def hold(self, account: str, model: str, until_unix: float) -> None:
        models = self._holds.setdefault(account, {})
        if model not in models:
            self._count += 1
        models[model] = max(until_unix, models.get(model, until_unix))

    def trip(self, base: str, variant: str, signature: str) -> None:
        if (base, variant) not in self._trips:
            self._count += 1
        self._trips[(base, variant)] = signature

    def drop_trips(self) -> None:
        """Forget the trips waiting (a reload ended them)."""
        self._count -= len(self._trips)
        self._trips = {}

    def take_holds(self, now_unix: float) -> list[tuple[str, list[tuple[str, int]]]]:
        """(account, [(model, ms left), ...]) to write, at most HOLDS_PER_CALL a run; ended
        holds are left out. Nothing waits afterwards."""
        runs = []
        for account, models in self._holds.items():
            left = [
                (m, ms) for m, end in models.items() if (ms := round((end - now_unix) * 1000)) > 0
            ]
            for i in range(0, len(left), HOLDS_PER_CALL):
                runs.append((account, left[i : i + HOLDS_PER_CALL]))
        self._count -= sum(len(models) for models in self._holds.values())
        self._holds = {}
        return runs

    def take_trips(self) -> list[tuple[str, str, str]]:
        """(base, variant, signature) to write. Nothing waits afterwards."""
        trips = [(base, variant, signature) for (base, variant), signature in self._trips.items()]
        self.drop_trips()
        return trips

    def clear(self) -> None:
        self._holds, self._trips, self._count = {}, {}, 0


def holds_key(prefix: str, account: str) -> str:
    return f"{prefix}:holds:{{{account}}}"


def trips_key(prefix: str) -> str:
    return f"{prefix}:trips"


def hold_note(account: str, model: str, left_ms: int, origin: str) -> str:
    """What a replica listening applies: the hold, with what is left of it (no clock time)."""
    return _json({"t": "hold", "a": account, "m": model, "l": left_ms, "o": origin})


def trip_note(base: str, variant: str, signature: str, origin: str) -> str:
    return _json({"t": "trip", "b": base, "v": variant, "s": signature, "o": origin})


def hold_call(
    prefix: str,
    channel: str,
    origin: str,
    account: str,
    holds: Iterable[tuple[str, int]],
    *,
    read: bool,
) -> Call:
    """Keep `holds` (model, ms left) of `account`; `read`: and reply with all of its holds."""
    args: list[str | int] = [channel, MAX_HOLDS, "1" if read else "0"]
    for model, left_ms in holds:
        args += [model, left_ms, hold_note(account, model, left_ms, origin)]
    return (holds_key(prefix, account),), args


def trips_call(
    prefix: str, channel: str, origin: str, trips: Iterable[tuple[str, str, str]]
) -> Call:
    """Keep `trips` (base, variant, signature); the reply lists every trip kept."""
    args: list[str | int] = ["put", channel]
    for base, variant, signature in trips:
        args += [_json([base, variant]), signature, trip_note(base, variant, signature, origin)]
    return (trips_key(prefix),), args


def clear_trips_call(prefix: str) -> Call:
    return (trips_key(prefix),), ["clear", ""]


def parse_holds(reply: Any) -> list[tuple[str, float]]:
    """(model, seconds left) of each hold in a `read` reply; anything else is skipped."""
    found = []
    for model, left in _pairs(reply):
        try:
            found.append((model, int(left) / 1000))
        except ValueError:
            continue
    return found


def parse_trips(reply: Any) -> list[tuple[str, str, str]]:
    """(base, variant, signature) of each trip a reply lists; fields not ours are skipped."""
    found = []
    for field, signature in _pairs(reply):
        try:
            base, variant = json.loads(field)
        except (ValueError, TypeError):
            continue
        if isinstance(base, str) and isinstance(variant, str):
            found.append((base, variant, signature))
    return found


def _pairs(reply: Any) -> list[tuple[str, str]]:
    """A flat reply `[k1, v1, k2, v2, ...]` as pairs of strings (none if it is not one)."""
    if not isinstance(reply, list) or not all(isinstance(r, str) for r in reply):
        return []
    return list(zip(reply[::2], reply[1::2], strict=False))


def _json(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))
