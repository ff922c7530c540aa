"""The Lua scripts that reserve and settle tenants' limits in Redis, atomically, on its clock.

One hash per limit: ``w`` the start of the window it counts (ms, Redis server time), ``n`` what
that window holds (reserved and used), ``c`` when this window's hash was made (Redis ``TIME``,
``seconds.microseconds``: tells a hash Redis lost and made again from the one a replica read),
``f`` the largest floor merged into it (below). A hash whose ``w`` is not the current window's
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
window start (ms), what is left after the reservation, ms until the window ends, ``c``.

``SETTLE`` -- KEYS: one per limit. ARGV: per key ``per``, the window start (ms) the
reservation was made in, the amount reserved, the amount to charge (0: a release). Where the
window is still the one reserved in, the reservation is replaced by the charge; where it has
rolled over, the charge goes to the current window (the usage became known there). Reply: per
key what its window holds now, its start (ms), ms until it ends, ``c``.

``MERGE`` -- after an outage, what one replica knows goes up. KEYS: one per limit. ARGV: per
key ``per``, the ``c`` of the hash it last read (``-``: none), that window's start (ms) and
what it held then (the floor), the start of the window its local share counted in and what the
share reserved on its own during the outage, not yet added. Where the hash is not the one read
(Redis restarted without its data) the floor comes back: ``n`` grows by what the floor exceeds
``f`` by, and ``f`` becomes the floor, so that replicas merging one after the other restore
the largest floor once, not one on top of the other; the local use is added in any case. A
start that is not the current window's drops its value (that window is over). Reply: as
``SETTLE``'s.

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

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local stamp = t[1] .. '.' .. t[2]

local function load(key, start)
  -- What the window starting at `start` holds, when its hash was made, the floor it took in.
  local v = redis.call('HMGET', key, 'w', 'n', 'c', 'f')
  if tonumber(v[1]) == start and v[3] then
    return tonumber(v[2]) or 0, v[3], tonumber(v[4]) or 0
  end
  return 0, stamp, 0
end

local function put(key, start, finish, value, born, floor)
  redis.call('HSET', key, 'w', int(start), 'n', num(value), 'c', born, 'f', num(floor))
  redis.call('PEXPIREAT', key, int(finish))
end
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
local starts, ends, before, borns, floors, seen = {}, {}, {}, {}, {}, {}
for i = 1, #KEYS do
  local per, amount, ask = ARGV[3 * i - 2], tonumber(ARGV[3 * i - 1]), tonumber(ARGV[3 * i])
  local start, finish = window(per, now)
  starts[i], ends[i] = start, finish
  before[i], borns[i], floors[i] = load(KEYS[i], start)
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
    put(KEYS[i], starts[i], ends[i], after, borns[i], floors[i])
  end
  table.insert(reply, int(starts[i]))
  table.insert(reply, num(math.max(0, amount - after)))
  table.insert(reply, int(ends[i] - now))
  table.insert(reply, borns[i])
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
  local value, born, floor = load(KEYS[i], start)
  if not seen[KEYS[i]] then
    seen[KEYS[i]] = true
    if reserved_in == start then value = value - amount end
    value = math.max(0, value + charge)
    put(KEYS[i], start, finish, value, born, floor)
  end
  table.insert(reply, num(value))
  table.insert(reply, int(start))
  table.insert(reply, int(finish - now))
  table.insert(reply, born)
end
return reply
"""
)

MERGE = Script(
    _COMMON
    + """
local reply, seen = {}, {}
for i = 1, #KEYS do
  local per, born_read = ARGV[6 * i - 5], ARGV[6 * i - 4]
  local floor_in, floor_read = tonumber(ARGV[6 * i - 3]), tonumber(ARGV[6 * i - 2])
  local add_in, add = tonumber(ARGV[6 * i - 1]), tonumber(ARGV[6 * i])
  local start, finish = window(per, now)
  local value, born, floor = load(KEYS[i], start)
  if not seen[KEYS[i]] then
    seen[KEYS[i]] = true
    -- Another hash than the one read: Redis lost that one; what it held comes back, once.
    if floor_in == start and born_read ~= born and floor_read > floor then
      value = value + floor_read - floor
      floor = floor_read
    end
    if add_in == start then value = value + add end
    put(KEYS[i], start, finish, value, born, floor)
  end
  table.insert(reply, num(value))
  table.insert(reply, int(start))
  table.insert(reply, int(finish - now))
  table.insert(reply, born)
end
return reply
"""
)
