-- Record a request's turn in its session's window and answer the session as it was.
-- KEYS[1] state hash, KEYS[2] window list, KEYS[3] the tenant's session index (zset).
-- ARGV: now_ms, encoded turn, its request hash (8 bytes), turns kept, ttl_ms, session id,
--       offset of the flags byte (0-based).
local now = tonumber(ARGV[1])
local state = redis.call('HGETALL', KEYS[1])
local window = redis.call('LRANGE', KEYS[2], 0, -1)
local retry = 0
local newest = window[#window]
if newest then
  local flags = string.byte(newest, tonumber(ARGV[7]) + 1)
  local answered = math.floor(flags / 2) % 2 == 1
  if string.sub(newest, 17, 24) == ARGV[3] and not answered then
    retry = 1
  end
end
if retry == 0 then
  redis.call('RPUSH', KEYS[2], ARGV[2])
  redis.call('LTRIM', KEYS[2], -tonumber(ARGV[4]), -1)
end
redis.call('HSETNX', KEYS[1], 'f', now)
redis.call('HSET', KEYS[1], 'l', now)
redis.call('HINCRBY', KEYS[1], 'n', 1)
local ttl = tonumber(ARGV[5])
-- A blocked session keeps the block's expiry.
if not redis.call('HGET', KEYS[1], 'bk') then
  redis.call('PEXPIRE', KEYS[1], ttl)
  redis.call('PEXPIRE', KEYS[2], ttl)
end
redis.call('ZADD', KEYS[3], now, ARGV[6])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - ttl)
redis.call('PEXPIRE', KEYS[3], ttl)
return {state, window, retry}
