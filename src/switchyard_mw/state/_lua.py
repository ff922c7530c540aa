"""The one Lua script every shared-state change runs through, atomically, on the Redis server.

Atomic because two replicas may change one account at once (both see the threshold, both see
the cooling end); on the server because only Redis's clock (``TIME``) is common to all
replicas: hosts' wall clocks may disagree, so no absolute time ever leaves Redis. Cooling ends
are stored in Redis time and reported as milliseconds from now.

KEYS: [1] the account hash {faults, period_ms, until_ms, cause, since_ms}; [2] the probe slot
(a string with a PX lease). ``until_ms`` = 0: no cooling in force; else the end of the current
cooling, which only a probe success resets. ``cause``: why the cooling that ends last started,
"o" (an outage) or "c" (refused credentials); absent means "o". ``since_ms``: when the cooling
in force began after a closed spell (0 or absent: unknown). ARGV: op, channel, origin, account
name, probe token, cooldown ms, max cooldown ms, failure threshold, probe lease ms, then
op-specific: ``local_cooled`` (0/1), ``local_period_ms``, ``local_faults``, ``local_left_ms``
("-": closed), ``local_cause`` (the cause of the replica's latest fault, "o" or "c"), then
``grace_ms``: a failed probe of an outage younger than this keeps the period (absent, from a
replica of an older version: it doubles, as it always did).

The same script keeps an (account, model) pair's faults where an account serves several models
(its own two keys, with the account's hash tag; the name is then :func:`unit_name`'s).

Reply and message (published only when something changed) share one format:
``kind|faults|period_ms|left_ms|probe_ms|origin|name``; left "-" when no cooling is in force,
probe "-" when not known; kind one of count, cool, closed, probe (a replica claimed the slot),
free, granted and held (answers to a claim, never published), followed by ``/credentials``
when a cooling is in force for refused credentials (an outage's cooling adds nothing, so its
messages read as before this field existed). The name goes last so it may contain "|".
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from ..core.pool import AccountSpec
from ..core.shared import Cause, Shared


@dataclass(frozen=True, slots=True)
class Script:
    """A Lua script and the SHA1 that ``EVALSHA`` names it by (computed here, as Redis does)."""

    text: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.text.encode()).hexdigest())


SCRIPT = """
local op, channel, origin, name, token = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local cooldown, maxp = tonumber(ARGV[6]), tonumber(ARGV[7])
local threshold, lease = tonumber(ARGV[8]), tonumber(ARGV[9])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local v = redis.call('HMGET', KEYS[1], 'faults', 'period_ms', 'until_ms', 'cause', 'since_ms')
local faults = tonumber(v[1]) or 0
local period = tonumber(v[2]) or cooldown
local untl = tonumber(v[3]) or 0
local cause = v[4] or 'o'
local since = tonumber(v[5]) or 0
local before = faults .. ':' .. period .. ':' .. untl .. ':' .. cause .. ':' .. since
local why = ARGV[14] or 'o'
local grace = tonumber(ARGV[15])
local probe = '-'
local kind = 'count'
local publish = false

local function cool(p)
  if untl == 0 then since = now end  -- an outage begins
  -- The end only ever moves later: a shorter second cooling leaves the longer one, and the
  -- cooling that ends last says why the account cools.
  if now + p >= untl then
    untl = now + p
    cause = why
  end
end

local function free_probe()
  if redis.call('GET', KEYS[2]) == token then
    redis.call('DEL', KEYS[2])
    probe = '0'
    publish = true
  else
    -- Our lease ran out and another replica holds the slot now: it is not free.
    local left = redis.call('PTTL', KEYS[2])
    if left > 0 then probe = string.format('%d', left) else probe = '0' end
  end
end

if op == 'fault' then
  faults = faults + 1
  if ARGV[10] == '1' then
    -- The replica cooled it: join that cooling (a longer one in force stays as it is).
    cool(tonumber(ARGV[11]))
    period = math.max(period, tonumber(ARGV[11]))
  elseif untl == 0 and faults >= threshold then
    cool(period)  -- the count reached the threshold across replicas
  end
elseif op == 'probe_fault' then
  faults = faults + 1
  if grace and why == 'o' and since > 0 and now - since < grace then
    period = math.max(period, tonumber(ARGV[11]))  -- a young outage: the same period again
  else
    period = math.max(math.min(period * 2, maxp), tonumber(ARGV[11]))
  end
  cool(period)
  free_probe()
elseif op == 'reset' then
  if untl == 0 then faults = 0 end
elseif op == 'probe_success' then
  -- A late success must not cut short a cooling a newer probe started.
  if untl <= now or redis.call('GET', KEYS[2]) == token then
    free_probe()
    faults, period, untl, since = 0, cooldown, 0, 0
    kind = 'closed'
    publish = true
  end
elseif op == 'probe_freed' then
  free_probe()
  kind = 'free'
elseif op == 'claim' then
  if untl <= now then
    if redis.call('SET', KEYS[2], token, 'NX', 'PX', lease) then
      kind, probe, publish = 'probe', string.format('%d', lease), true
    else
      kind, probe = 'held', string.format('%d', math.max(redis.call('PTTL', KEYS[2]), 1))
    end
  end
elseif op == 'merge' then
  -- After an outage: what this replica learnt alone joins the shared state, by max().
  faults = math.max(faults, tonumber(ARGV[12]))
  period = math.max(period, tonumber(ARGV[11]))
  if ARGV[13] ~= '-' then cool(tonumber(ARGV[13])) end
  local left = redis.call('PTTL', KEYS[2])
  if left > 0 then probe = string.format('%d', left) else probe = '0' end
end

if before ~= faults .. ':' .. period .. ':' .. untl .. ':' .. cause .. ':' .. since then
  publish = true
  redis.call('HSET', KEYS[1], 'faults', string.format('%d', faults),
    'period_ms', string.format('%d', period), 'until_ms', string.format('%d', untl),
    'cause', cause, 'since_ms', string.format('%d', since))
end
if kind == 'count' and untl > 0 then kind = 'cool' end
if kind == 'free' and untl > 0 then kind = 'cool' end
local left = '-'
local refused = ''
if untl > 0 then
  left = string.format('%d', untl - now)
  if cause == 'c' then refused = '/credentials' end
end
local function message(k)
  return k .. refused .. '|' .. faults .. '|' .. string.format('%d', period) .. '|' .. left ..
    '|' .. probe .. '|' .. origin .. '|' .. name
end
if publish then redis.call('PUBLISH', channel, message(kind)) end
if kind == 'probe' then return message('granted') end
return message(kind)
"""
ACCOUNT = Script(SCRIPT)


def keys(prefix: str, account: str, model: str | None = None) -> tuple[str, str]:
    """KEYS of one account (with `model`: of that pair): its hash, its probe slot. The braces
    are a Cluster hash tag: an account's pairs live in its slot."""
    if model is None:
        return f"{prefix}:account:{{{account}}}", f"{prefix}:probe:{{{account}}}"
    return f"{prefix}:pair:{{{account}}}:{model}", f"{prefix}:pairprobe:{{{account}}}:{model}"


_PAIR = "\x1f"
"""Opens the name of a pair in the script's replies and messages (a control character no
config names an account with); a replica of an older version reads it as an unknown account
and ignores it."""


def unit_name(account: str, model: str | None) -> str:
    """What replies and messages call an account (its name) or a pair (JSON after `_PAIR`)."""
    if model is None:
        return account
    return _PAIR + json.dumps([account, model], separators=(",", ":"))


def unit_of(name: str) -> tuple[str, str | None]:
    """(account, model or None) from :func:`unit_name`'s; ValueError if it is not one."""
    if not name.startswith(_PAIR):
        return name, None
    account, model = json.loads(name[1:])
    if not isinstance(account, str) or not isinstance(model, str):
        raise ValueError("not a pair")
    return account, model


def script_args(
    op: str,
    channel: str,
    origin: str,
    spec: AccountSpec,
    token: str,
    lease_ms: int,
    local: Shared | None,
    model: str | None = None,
) -> list[str | int]:
    """ARGV for one run of :data:`SCRIPT`, in the order its header lists."""
    cooled = local is not None and local.cooled_for_secs is not None
    left = "-" if local is None or local.cooled_for_secs is None else ms(local.cooled_for_secs)
    return [
        op,
        channel,
        origin,
        unit_name(spec.name, model),
        token,
        ms(spec.cooldown_secs),
        ms(spec.max_cooldown_secs),
        spec.failure_threshold,
        lease_ms,
        "1" if cooled else "0",
        ms(local.period_secs) if local else 0,
        local.faults if local else 0,
        left,
        _CAUSES[local.cause] if local else "o",
        ms(spec.max_cooldown_secs),
    ]


def parse(reply: str) -> tuple[str, str, Shared]:
    """``kind|faults|period_ms|left_ms|probe_ms|origin|name`` -> (kind, origin, state)."""
    # ValueError on anything else (another program may publish on the channel).
    kind, faults, period, left, probe, origin, _ = reply.split("|", 6)
    kind, _, why = kind.partition("/")
    shared = Shared(
        int(faults),
        int(period) / 1000,
        None if left == "-" else int(left) / 1000,
        kind == "closed",
        None if probe == "-" else int(probe) / 1000,
        Cause.CREDENTIALS if why == "credentials" else Cause.OUTAGE,
    )
    return kind, origin, shared


_CAUSES = {Cause.OUTAGE: "o", Cause.CREDENTIALS: "c"}


def name_of(reply: str) -> str:
    """The account a reply or message is about."""
    return reply.split("|", 6)[6]


def ms(secs: float) -> int:
    return round(secs * 1000)
