-- Write a decision back. KEYS[1] state hash, KEYS[2] window list, KEYS[3] the tenant's blocked
-- sessions (zset by the time they were blocked).
-- ARGV: flagged (0/1), refused (0/1), avoided micros, cooldown_until_ms ('' to keep),
--       blocked_at_ms ('' to keep), loop note JSON ('' to keep), session id, block ttl ms.
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
if ARGV[1] == '1' then redis.call('HINCRBY', KEYS[1], 'fl', 1) end
if ARGV[2] == '1' then
  redis.call('HINCRBY', KEYS[1], 'rf', 1)
  redis.call('HINCRBY', KEYS[1], 'av', tonumber(ARGV[3]))
end
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'cd', ARGV[4]) end
if ARGV[6] ~= '' then redis.call('HSET', KEYS[1], 'lp', ARGV[6]) end
if ARGV[5] ~= '' then
  -- Blocked until an admin clears it or the block's ttl ends (the index keeps it listed).
  local at = tonumber(ARGV[5])
  local ttl = tonumber(ARGV[8])
  -- The first block stands: its time, and the expiry counted from it.
  if not redis.call('HGET', KEYS[1], 'bk') then
    redis.call('HSET', KEYS[1], 'bk', ARGV[5])
    redis.call('PEXPIRE', KEYS[1], ttl)
    redis.call('PEXPIRE', KEYS[2], ttl)
    redis.call('ZADD', KEYS[3], at, ARGV[7])
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', at - ttl)
  redis.call('PEXPIRE', KEYS[3], ttl)
end
return 1
