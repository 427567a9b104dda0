-- Commit actual usage against reservations: a batch of commits of one tenant (one cluster slot),
-- each applied once per reservation id. ARGV[1] = number of commits; then per commit
--   ARGV: rid, now_ms, dedupe_ms, tokens, micros, unreserved, n_counters, expire_at_ms per
--         counter, n_rates, then per token limiter per_minute, tokens to give back;
--   KEYS: the commit marker (used only when unreserved), (counter hash, reservation zset) per
--         counter, one key per token limiter.
-- Reply: per commit 1 applied, 0 already committed.
--
-- A reserved commit is idempotent through the reservation itself: it applies to a counter that
-- still holds r:<rid> (live) or x:<rid> (expired, not yet committed) and consumes it, so a retry
-- finds neither and changes nothing. An unreserved commit (spend admitted while Redis was
-- unreachable) has no reservation and is deduplicated by a marker key instead.
local out = {}
local ka, aa = 0, 1
for c = 1, tonumber(ARGV[1]) do
  local rid = ARGV[aa + 1]
  local tokens, micros = tonumber(ARGV[aa + 4]), tonumber(ARGV[aa + 5])
  local unreserved = ARGV[aa + 6] == '1'
  local nc = tonumber(ARGV[aa + 7])
  local rb = aa + 7 + nc
  local nr = tonumber(ARGV[rb + 1])
  local applied = false
  if unreserved then
    if redis.call('SET', KEYS[ka + 1], '1', 'NX', 'PX', ARGV[aa + 3]) then
      for i = 1, nc do
        local h = KEYS[ka + 2 * i]
        redis.call('HINCRBY', h, 'st', ARGV[aa + 4])
        redis.call('HINCRBY', h, 'sm', ARGV[aa + 5])
        redis.call('PEXPIREAT', h, ARGV[aa + 7 + i])
      end
      applied = true
    end
  else
    applied = nc == 0
    for i = 1, nc do
      local h, z = KEYS[ka + 2 * i], KEYS[ka + 2 * i + 1]
      local v = redis.call('HMGET', h, 'r:' .. rid, 'x:' .. rid, 'st', 'sm', 'rt', 'rm')
      local st, sm = (tonumber(v[3]) or 0) + tokens, (tonumber(v[4]) or 0) + micros
      if v[1] then
        local sep = string.find(v[1], ':', 1, true)
        local rt = (tonumber(v[5]) or 0) - tonumber(string.sub(v[1], 1, sep - 1))
        local rm = (tonumber(v[6]) or 0) - tonumber(string.sub(v[1], sep + 1))
        redis.call('HSET', h, 'st', fmt(st), 'sm', fmt(sm), 'rt', fmt(rt), 'rm', fmt(rm))
        redis.call('HDEL', h, 'r:' .. rid)
        redis.call('ZREM', z, rid)
        applied = true
      elseif v[2] then
        redis.call('HSET', h, 'st', fmt(st), 'sm', fmt(sm))
        redis.call('HDEL', h, 'x:' .. rid)
        applied = true
      end
    end
    if applied then
      for j = 1, nr do
        local key = KEYS[ka + 1 + 2 * nc + j]
        local tat = tonumber(redis.call('GET', key))
        if tat then
          local per_minute = tonumber(ARGV[rb + 2 * j])
          tat = tat - tonumber(ARGV[rb + 2 * j + 1]) * (60000000 / math.max(per_minute, 1))
          if tat < 0 then tat = 0 end
          redis.call('SET', key, fmt(tat), 'KEEPTTL')
        end
      end
    end
  end
  out[c] = applied and 1 or 0
  ka = ka + 1 + 2 * nc + nr
  aa = rb + 1 + 2 * nr
end
return out
