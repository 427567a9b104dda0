-- Set a counter's spent totals unless it exists. KEYS: the counter hash.
-- ARGV: tokens, micros, expire_at_ms. Reply: 1 set, 0 already there.
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
redis.call('HSET', KEYS[1], 'st', ARGV[1], 'sm', ARGV[2], 'rt', 0, 'rm', 0)
redis.call('PEXPIREAT', KEYS[1], ARGV[3])
return 1
