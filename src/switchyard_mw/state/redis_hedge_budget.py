"""The hedge budget shared across replicas through Redis (the local one: ``core/hedge_budget``).

One hash per model, ``{prefix}hedge:{model}``, with a field per window bucket and counter:
``r:<bucket>`` (requests) and ``h:<bucket>`` (hedges). One key, so the script runs on a
cluster too; its fields are the window's buckets only (older ones are deleted as the script
passes), and a ``PEXPIRE`` of two windows drops a model that stopped taking traffic. The bucket
index comes from Redis ``TIME``: hosts' clocks may disagree, Redis's is the one all share.
The ratio is compared in the same exact fraction as the local budget:
``(hedges + 1) * den <= num * requests``.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import redis.asyncio as aioredis

from ..core.hedge_budget import HedgeVerdict

SCRIPT = """
local op, width, n = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local num, den = tonumber(ARGV[4]), tonumber(ARGV[5])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cur = math.floor(now / width)
local oldest = cur - n + 1
local all = redis.call('HGETALL', KEYS[1])
local r, h = 0, 0
for i = 1, #all, 2 do
  local field = all[i]
  local bucket = tonumber(string.sub(field, 3))
  if bucket < oldest then
    redis.call('HDEL', KEYS[1], field)
  elseif string.sub(field, 1, 1) == 'r' then
    r = r + tonumber(all[i + 1])
  else
    h = h + tonumber(all[i + 1])
  end
end
local field, started = 'r:', 1
if op == 'try' then
  field = 'h:'
  if (h + 1) * den > num * r then started = 0 end
end
if started == 1 then
  redis.call('HINCRBY', KEYS[1], field .. cur, 1)
  -- After the increment: on a key the pruning emptied, HINCRBY makes a new key with no expiry.
  redis.call('PEXPIRE', KEYS[1], width * n * 2)
end
return started
"""


class SharedHedgeBudget:
    """Counts one model's requests and hedges across every replica that shares the store."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        key_prefix: str,
        model: str,
        max_ratio: float,
        window_secs: float,
        buckets: int,
    ) -> None:
        width_ms = round(window_secs * 1000 / buckets)
        if not 0.0 <= max_ratio <= 1.0 or width_ms < 1 or buckets < 1:
            raise ValueError("need 0 <= max_ratio <= 1 and buckets of at least 1 ms")
        ratio = Fraction(repr(float(max_ratio)))
        self._key = f"{key_prefix}hedge:{model}"
        self._args = (width_ms, buckets, ratio.numerator, ratio.denominator)
        self._script: Any = client.register_script(SCRIPT)

    async def note_request(self) -> None:
        await self._script(keys=[self._key], args=["note", *self._args])

    async def try_hedge(self) -> HedgeVerdict:
        started = await self._script(keys=[self._key], args=["try", *self._args])
        return HedgeVerdict.START if int(started) == 1 else HedgeVerdict.REFUSED
