-- Write a decision back. KEYS[1] state hash, KEYS[2] window list, KEYS[3] the tenant's set of
-- blocked sessions.
-- ARGV: flagged (0/1), refused (0/1), avoided micros, cooldown_until_ms ('' to keep),
--       blocked_at_ms ('' to keep), loop note JSON ('' to keep), session id.
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
  redis.call('HSET', KEYS[1], 'bk', ARGV[5])
  -- Blocked until an admin clears it: nothing expires (the index keeps it listed).
  redis.call('PERSIST', KEYS[1])
  redis.call('PERSIST', KEYS[2])
  redis.call('SADD', KEYS[3], ARGV[7])
end
return 1
