-- RL.CHECKALL as a Lua script, for servers that cannot load the module (managed Redis).
-- Same arguments, validation, reply and stored format as the module, so both can serve one
-- deployment side by side (see redis_ratelimit_core::stored):
--   KEYS = one bucket key per limit; ARGV = rate, burst, cost for each key, in order.
--   Reply: one {allowed, remaining, retry_after_ms, reset_after_ms} per limit.
-- Time is counted in ticks of 100 ns. Lua numbers are doubles, so every quantity is kept
-- relative to the current millisecond (now_ms) and stays below 2^53: the arithmetic is then
-- exact and gives the module's results.
local TICKS_PER_MS = 10000
local MAX_RATE = 10000000
local MAX_REFILL = 1000000000000000

local n = #KEYS
if n == 0 or #ARGV ~= 3 * n then
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
  if cost == nil or cost < 0 then return redis.error_reply('ERR cost must be an integer >= 0') end
  limits[i] = { interval = interval, burst = burst, tau = burst * interval, cost = cost }
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
      local sub = nil
      if string.match(v, '^%d+$') and #v <= 4 and (v == '0' or string.sub(v, 1, 1) ~= '0') then
        sub = tonumber(v)
      end
      if sub == nil then
        return redis.error_reply('ERR key is not a rate-limit bucket: its value is not an integer in 0..9999')
      end
      if expire_at < 0 then
        return redis.error_reply('ERR key is not a rate-limit bucket: it has no expiry')
      end
      tat = (expire_at - now_ms) * TICKS_PER_MS - sub
    end
    before[k] = tat
  end
end

-- One limit against a bucket: redis_ratelimit_core::check, step for step.
local function evaluate(l, tat, take)
  tat = math.min(math.max(tat, now), now + l.tau)
  local used = tat - now
  local allowed, retry = 0, -1
  if l.cost <= l.burst then
    local need = l.cost * l.interval
    if used + need <= l.tau then
      allowed, retry = 1, 0
    else
      retry = math.ceil((used + need - l.tau) / TICKS_PER_MS)
    end
  end
  local changed = take and allowed == 1 and l.cost > 0
  if changed then tat = tat + l.cost * l.interval end
  local deficit = tat - now
  local reset = 0
  if deficit > 0 then reset = math.ceil(tat / TICKS_PER_MS) end
  return { allowed, math.floor((l.tau - deficit) / l.interval), retry, reset }, tat, changed
end

-- All or nothing: a key named twice sees the earlier take.
local tentative, replies, all = {}, {}, true
for k, tat in pairs(before) do tentative[k] = tat end
for i = 1, n do
  local reply, tat, changed = evaluate(limits[i], tentative[KEYS[i]], true)
  if changed then tentative[KEYS[i]] = tat end
  if reply[1] == 0 then all = false end
  replies[i] = reply
end

if all then
  for k, tat in pairs(tentative) do
    if tat ~= before[k] then
      local expire_rel = math.ceil(tat / TICKS_PER_MS)
      redis.call('SET', k, expire_rel * TICKS_PER_MS - tat, 'PXAT', now_ms + expire_rel)
    end
  end
else
  for i = 1, n do
    local untouched = evaluate(limits[i], before[KEYS[i]], false)
    replies[i][2] = untouched[2]
    replies[i][4] = untouched[4]
  end
end
return replies
