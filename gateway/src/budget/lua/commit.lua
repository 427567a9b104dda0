-- Commit actual usage against a reservation, once per reservation id. KEYS: the commit marker,
-- then (counter hash, reservation zset) per counter, then one key per token rate limiter.
-- ARGV: rid, now_ms, dedupe_ms, tokens, micros, n_counters, expire_at_ms per counter, n_rates,
-- then per limiter per_minute, tokens to give back. Reply: 1 applied, 0 already committed.
local rid = ARGV[1]
local tokens = tonumber(ARGV[4])
local micros = tonumber(ARGV[5])
local nc = tonumber(ARGV[6])
if not redis.call('SET', KEYS[1], '1', 'NX', 'PX', ARGV[3]) then
  return 0
end
for i = 1, nc do
  local h, z = KEYS[2 * i], KEYS[2 * i + 1]
  release(h, rid)
  redis.call('ZREM', z, rid)
  redis.call('HINCRBY', h, 'st', ARGV[4])
  redis.call('HINCRBY', h, 'sm', ARGV[5])
  redis.call('PEXPIREAT', h, ARGV[6 + i])
end
local rbase = 6 + nc
local nr = tonumber(ARGV[rbase + 1])
for j = 1, nr do
  local key = KEYS[1 + 2 * nc + j]
  local tat = tonumber(redis.call('GET', key))
  if tat then
    local per_minute = tonumber(ARGV[rbase + 2 * j])
    local refund = tonumber(ARGV[rbase + 2 * j + 1])
    tat = tat - refund * (60000000 / math.max(per_minute, 1))
    if tat < 0 then tat = 0 end
    redis.call('SET', key, fmt(tat), 'KEEPTTL')
  end
end
return 1
