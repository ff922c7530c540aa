"""The Lua scripts that reserve and settle tenants' limits in Redis, atomically, on its clock.

One hash per limit, ``{w, n}``: the start of the window it counts (ms, Redis server time) and
what that window holds (reserved and used). A hash whose ``w`` is not the current window's
start counts as empty, and is replaced the next time the limit is touched, as
`core.limits.Ledger` replaces its counters; each write sets the key to expire when its window
ends (``PEXPIREAT``), so an idle limit leaves nothing behind. Windows are computed here from
``TIME``: replicas' clocks need not agree, and a calendar month is a calendar month of Redis's
clock.

Amounts travel as decimal strings (Python's ``repr`` of a float, Lua's ``%.17g``): both read
back the same double, so the comparison ``used + ask > amount`` is the ledger's to the bit,
and a reply never passes through Redis's integer conversion of Lua numbers.

``RESERVE`` -- KEYS: one per limit. ARGV: per key ``per``, ``amount`` (the limit), ``ask``.
Every limit is checked before any is written (all or nothing). Reply: ``refused``, the
(1-based) index of the first key that does not fit, ``1`` if the ask alone exceeds the limit
(else ``0``), what is left of it, ms until its window ends; or ``granted`` then, per key, the
window start (ms), what is left after the reservation, ms until the window ends.

``SETTLE`` -- KEYS: one per limit. ARGV: per key ``per``, the window start (ms) the
reservation was made in, the amount reserved, the amount to charge (0: a release). Where the
window is still the one reserved in, the reservation is replaced by the charge; where it has
rolled over, the charge goes to the current window (the usage became known there). Reply: per
key what its window holds now and ms until it ends.

A key listed twice in one call (two configured limits counting the same thing with different
amounts) is one counter: counted once.
"""

from __future__ import annotations

from ._lua import Script

_COMMON = """
local function civil(days)
  -- The (year, month) of a day count from 1970-01-01 (H. Hinnant's civil_from_days).
  local z = days + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524)
    - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return y, m
end

local function first_day(y, m)
  -- Days from 1970-01-01 to the first of month m of year y (days_from_civil).
  if m <= 2 then y = y - 1 end
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local mp = m > 2 and m - 3 or m + 9
  local doy = math.floor((153 * mp + 2) / 5)
  local doe = yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + doy
  return era * 146097 + doe - 719468
end

local SIZES = {second = 1000, minute = 60000, hour = 3600000, day = 86400000}

local function window(per, now)
  -- The start and end (ms) of the window of kind `per` holding `now` (ms).
  local size = SIZES[per]
  if size then
    local start = math.floor(now / size) * size
    return start, start + size
  end
  local y, m = civil(math.floor(now / 86400000))
  local ny, nm = y, m + 1
  if nm == 13 then ny, nm = y + 1, 1 end
  return first_day(y, m) * 86400000, first_day(ny, nm) * 86400000
end

local function num(value) return string.format('%.17g', value) end
local function int(value) return string.format('%d', value) end

local function held(key, start)
  local v = redis.call('HMGET', key, 'w', 'n')
  if tonumber(v[1]) == start then return tonumber(v[2]) or 0 end
  return 0
end

local function put(key, start, finish, value)
  redis.call('HSET', key, 'w', int(start), 'n', num(value))
  redis.call('PEXPIREAT', key, int(finish))
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

WINDOW_TEXT = (
    _COMMON
    + """
local start, finish = window(ARGV[1], tonumber(ARGV[2]))
return {int(start), int(finish)}
"""
)
"""For tests: the script's windows for a given time (ms), against `core.limits.window`."""

RESERVE = Script(
    _COMMON
    + """
local starts, ends, before, seen = {}, {}, {}, {}
for i = 1, #KEYS do
  local per, amount, ask = ARGV[3 * i - 2], tonumber(ARGV[3 * i - 1]), tonumber(ARGV[3 * i])
  local start, finish = window(per, now)
  starts[i], ends[i] = start, finish
  before[i] = held(KEYS[i], start)
  if ask > amount or before[i] + ask > amount then
    local never = ask > amount and '1' or '0'
    return {'refused', int(i), never, num(math.max(0, amount - before[i])), int(finish - now)}
  end
end
local reply = {'granted'}
for i = 1, #KEYS do
  local amount, ask = tonumber(ARGV[3 * i - 1]), tonumber(ARGV[3 * i])
  local after = before[i] + ask
  if not seen[KEYS[i]] then
    seen[KEYS[i]] = true
    put(KEYS[i], starts[i], ends[i], after)
  end
  table.insert(reply, int(starts[i]))
  table.insert(reply, num(math.max(0, amount - after)))
  table.insert(reply, int(ends[i] - now))
end
return reply
"""
)

SETTLE = Script(
    _COMMON
    + """
local reply, seen = {}, {}
for i = 1, #KEYS do
  local per, reserved_in = ARGV[4 * i - 3], tonumber(ARGV[4 * i - 2])
  local amount, charge = tonumber(ARGV[4 * i - 1]), tonumber(ARGV[4 * i])
  local start, finish = window(per, now)
  local value = held(KEYS[i], start)
  if not seen[KEYS[i]] then
    seen[KEYS[i]] = true
    if reserved_in == start then value = value - amount end
    value = math.max(0, value + charge)
    put(KEYS[i], start, finish, value)
  end
  table.insert(reply, num(value))
  table.insert(reply, int(finish - now))
end
return reply
"""
)
