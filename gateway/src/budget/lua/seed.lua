-- Seed a counter from the ledger unless it is seeded (field sd). KEYS: the counter hash.
-- ARGV: tokens, micros, expire_at_ms. Spent totals become the larger of the counter's (commits
-- made after its data was lost) and the ledger's, so nothing is counted twice. Reply: 1 seeded
-- now, 0 already seeded.
if redis.call('HEXISTS', KEYS[1], 'sd') == 1 then
  return 0
end
local v = redis.call('HMGET', KEYS[1], 'st', 'sm')
local st = math.max(tonumber(v[1]) or 0, tonumber(ARGV[1]))
local sm = math.max(tonumber(v[2]) or 0, tonumber(ARGV[2]))
redis.call('HSET', KEYS[1], 'st', string.format('%.0f', st), 'sm', string.format('%.0f', sm), 'sd', '1')
redis.call('HSETNX', KEYS[1], 'rt', 0)
redis.call('HSETNX', KEYS[1], 'rm', 0)
redis.call('PEXPIREAT', KEYS[1], ARGV[3])
return 1
