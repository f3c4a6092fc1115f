-- The usual token-bucket script RL.CHECK replaces (the baseline for scripts/bench):
-- KEYS[1] = bucket, ARGV = rate (tokens/s), burst, cost.
-- State is a hash {tokens, ts} with a TTL; time comes from the server's TIME.
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(state[1]) or burst
local ts = tonumber(state[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - ts) * rate)
local allowed = 0
local retry_ms = 0
if tokens >= cost then
  allowed = 1
  tokens = tokens - cost
  if cost > 0 then
    redis.call('HSET', KEYS[1], 'tokens', tokens, 'ts', now)
    redis.call('PEXPIRE', KEYS[1], math.ceil((burst - tokens) / rate * 1000))
  end
else
  retry_ms = math.ceil((cost - tokens) / rate * 1000)
end
local reset_ms = math.ceil((burst - tokens) / rate * 1000)
return {allowed, math.floor(tokens), retry_ms, reset_ms}
