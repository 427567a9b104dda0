-- Commit actual usage against a reservation, once per reservation id. KEYS: the commit marker
-- (used only for unreserved commits), then (counter hash, reservation zset) per counter, then one
-- key per token rate limiter. ARGV: rid, now_ms, dedupe_ms, tokens, micros, unreserved,
-- n_counters, expire_at_ms per counter, n_rates, then per limiter per_minute, tokens to give
-- back. Reply: 1 applied, 0 already committed.
--
-- A reserved commit is idempotent through the reservation itself: it applies to a counter that
-- still holds r:<rid> (live) or x:<rid> (expired, not yet committed) and consumes it, so a retry
-- finds neither and changes nothing. An unreserved commit (spend admitted while Redis was
-- unreachable) has no reservation and is deduplicated by a marker key instead.
local rid = ARGV[1]
local nc = tonumber(ARGV[7])
local function spend(h, i)
  redis.call('HINCRBY', h, 'st', ARGV[4])
  redis.call('HINCRBY', h, 'sm', ARGV[5])
  redis.call('PEXPIREAT', h, ARGV[7 + i])
end
if ARGV[6] == '1' then
  if not redis.call('SET', KEYS[1], '1', 'NX', 'PX', ARGV[3]) then
    return 0
  end
  for i = 1, nc do
    spend(KEYS[2 * i], i)
  end
  return 1
end
local applied = nc == 0
for i = 1, nc do
  local h, z = KEYS[2 * i], KEYS[2 * i + 1]
  local live = redis.call('HEXISTS', h, 'r:' .. rid) == 1
  if live then
    release(h, rid)
    redis.call('ZREM', z, rid)
  end
  if live or redis.call('HDEL', h, 'x:' .. rid) == 1 then
    spend(h, i)
    applied = true
  end
end
if not applied then
  return 0
end
local rbase = 7 + nc
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
