-- RL.CHECKALL (and RL.SETTLE) as a Lua script, for servers that cannot load the module
-- (managed Redis). Same arguments, validation, reply and stored format as the module, so both
-- can serve one deployment side by side (see redis_ratelimit_core::stored):
--   KEYS = one bucket key per limit; ARGV = rate, burst, cost for each key, in order.
--   Reply: one {allowed, remaining, retry_after_ms, reset_after_ms} per limit.
-- With one more ARGV, the word 'settle', each triple is rate, burst, delta instead and every
-- key is settled as RL.SETTLE would (charged into debt or refunded up to full), independently.
-- Time is counted in ticks of 100 ns. Lua numbers are doubles, so every quantity is kept
-- relative to the current millisecond (now_ms) and stays below 2^53: the arithmetic is then
-- exact and gives the module's results.
local TICKS_PER_MS = 10000
local MAX_RATE = 10000000
local MAX_REFILL = 1000000000000000
local MAX_LEAD = 2 * MAX_REFILL
local LINGER_MS = { [0] = 0, 1000, 4000, 15000, 60000 }
local CLASSES = 5

local n = #KEYS
local settling = n > 0 and #ARGV == 3 * n + 1 and ARGV[#ARGV] == 'settle'
if n == 0 or (#ARGV ~= 3 * n and not settling) then
  return redis.error_reply("ERR wrong number of arguments for 'rl.checkall' command")
end

-- A 64-bit signed integer in decimal, as the module reads one (sign, leading zeros allowed).
local function integer(s)
  local sign, digits = string.match(s, '^([+-]?)(%d+)$')
  if not digits then return nil end
  digits = string.match(digits, '^0*(%d-)$')
  if digits == '' then return 0 end
  local limit = '9223372036854775807'
  if sign == '-' then limit = '9223372036854775808' end
  if #digits > 19 or (#digits == 19 and digits > limit) then return nil end
  local v = tonumber(digits)
  if sign == '-' then v = -v end
  return v
end

local function number(s)
  local l = string.lower(s)
  if not string.match(l, '^[%d%.e+-]+$') and not string.match(l, '^[+-]?inf') and
     not string.match(l, '^[+-]?nan$') then
    return nil
  end
  return tonumber(s)
end

-- Validate every limit before reading any key, in the module's order.
local limits = {}
for i = 1, n do
  local rate = number(ARGV[3 * i - 2])
  if rate == nil then return redis.error_reply('ERR rate must be a number (tokens per second)') end
  local burst = integer(ARGV[3 * i - 1])
  if burst == nil or burst < 1 then return redis.error_reply('ERR burst must be an integer >= 1') end
  if rate ~= rate or rate == math.huge or rate == -math.huge then
    return redis.error_reply('ERR rate must be a finite number')
  end
  if rate <= 0 then return redis.error_reply('ERR rate must be greater than 0') end
  if rate > MAX_RATE then
    return redis.error_reply('ERR rate must be at most 10000000 tokens per second')
  end
  local interval = math.ceil(MAX_RATE / rate)
  if interval > MAX_REFILL or burst * interval > MAX_REFILL then
    return redis.error_reply('ERR burst / rate is too long (at most 100000000 seconds)')
  end
  local cost = integer(ARGV[3 * i])
  if settling then
    if cost == nil then
      return redis.error_reply('ERR delta must be an integer (tokens; negative refunds)')
    end
  elseif cost == nil or cost < 0 then
    return redis.error_reply('ERR cost must be an integer >= 0')
  end
  -- Linger class: the smallest linger at least the refill time (stored::linger_class).
  local refill_ms = math.ceil(burst * interval / TICKS_PER_MS)
  local class = CLASSES - 1
  for c = 1, CLASSES - 1 do
    if LINGER_MS[c] >= refill_ms then class = c; break end
  end
  limits[i] = { interval = interval, burst = burst, tau = burst * interval, cost = cost, class = class }
end

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local now = (tonumber(t[2]) % 1000) * 10 -- ticks after now_ms; TATs below are relative to it

-- Read every distinct key. A missing key is a full bucket (TAT 0 <= now).
local before = {}
for i = 1, n do
  local k = KEYS[i]
  if before[k] == nil then
    local tat = 0
    local expire_at = redis.call('PEXPIRETIME', k)
    if expire_at ~= -2 then
      local v = redis.call('GET', k) -- WRONGTYPE for another type
      local value = nil
      if string.match(v, '^%d+$') and #v <= 5 and (v == '0' or string.sub(v, 1, 1) ~= '0') then
        value = tonumber(v)
        if value >= CLASSES * TICKS_PER_MS then value = nil end
      end
      if value == nil then
        return redis.error_reply('ERR key is not a rate-limit bucket: its value is not an integer in 0..49999')
      end
      if expire_at < 0 then
        return redis.error_reply('ERR key is not a rate-limit bucket: it has no expiry')
      end
      local sub = value % TICKS_PER_MS
      local full_at = expire_at - LINGER_MS[(value - sub) / TICKS_PER_MS]
      if full_at < 0 or full_at > 1844674407370955 or (full_at == 0 and sub > 0) then
        return redis.error_reply('ERR key is not a rate-limit bucket: its expiry is out of range')
      end
      tat = (full_at - now_ms) * TICKS_PER_MS - sub
    end
    before[k] = tat
  end
end

-- The reply for a bucket at `tat` (relative, not before now) under limit l.
local function state(l, allowed, retry, tat)
  local deficit = tat - now
  local reset = 0
  if deficit > 0 then reset = math.ceil(tat / TICKS_PER_MS) end
  return { allowed, math.floor((l.tau - deficit) / l.interval), retry, reset }
end

-- Stores a bucket at `tat` (relative) written under linger class `class`.
local function store(k, tat, class)
  local full_rel = math.ceil(tat / TICKS_PER_MS)
  local value = class * TICKS_PER_MS + (full_rel * TICKS_PER_MS - tat)
  redis.call('SET', k, value, 'PXAT', now_ms + full_rel + LINGER_MS[class])
end

if settling then
  -- redis_ratelimit_core::settle for each key: validate every debt first, then write.
  local after, replies = {}, {}
  for i = 1, n do
    local l, k = limits[i], KEYS[i]
    local tat = math.max(after[k] or before[k], now)
    local delta = l.cost
    local new = tat
    if delta > 0 then
      new = tat + delta * l.interval
      if new - now > MAX_LEAD then
        return redis.error_reply('ERR delta would put the bucket in debt for more than 200000000 seconds')
      end
    elseif delta < 0 then
      new = math.max(tat + delta * l.interval, now)
    end
    after[k] = new
    replies[i] = state(l, 1, 0, new)
  end
  for k, tat in pairs(after) do
    if tat ~= math.max(before[k], now) then
      local class = 0
      for i = 1, n do
        if KEYS[i] == k and limits[i].class > class then class = limits[i].class end
      end
      store(k, tat, class)
    end
  end
  return replies
end

-- One limit against a bucket: redis_ratelimit_core::check, step for step. A TAT beyond
-- now + tau (debt, a shrunk limit, a clock stepped back) is honoured, not clamped.
local function evaluate(l, tat, take)
  tat = math.max(tat, now)
  local used = tat - now
  local allowed, retry = 0, -1
  if l.cost > l.burst then
    allowed, retry = 0, -1
  elseif l.cost == 0 then
    allowed, retry = 1, 0
  else
    local short = used + l.cost * l.interval - l.tau
    if short <= 0 then
      allowed, retry = 1, 0
    else
      retry = math.ceil(short / TICKS_PER_MS)
    end
  end
  local changed = take and allowed == 1 and l.cost > 0
  if changed then tat = tat + l.cost * l.interval end
  return state(l, allowed, retry, tat), tat, changed
end

-- All or nothing: a key named twice sees the earlier take, and is written with the longest
-- linger of the limits naming it.
local tentative, classes, replies, all = {}, {}, {}, true
for k, tat in pairs(before) do tentative[k] = tat; classes[k] = 0 end
for i = 1, n do
  local k = KEYS[i]
  local reply, tat, changed = evaluate(limits[i], tentative[k], true)
  if changed then tentative[k] = tat end
  if limits[i].class > classes[k] then classes[k] = limits[i].class end
  if reply[1] == 0 then all = false end
  replies[i] = reply
end

if all then
  for k, tat in pairs(tentative) do
    if tat ~= before[k] then store(k, tat, classes[k]) end
  end
else
  for i = 1, n do
    local untouched = evaluate(limits[i], before[KEYS[i]], false)
    replies[i][2] = untouched[2]
    replies[i][4] = untouched[4]
  end
end
return replies
