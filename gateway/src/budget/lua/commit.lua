-- Commit actual usage against reservations: a batch of commits of one tenant (one cluster slot),
-- each applied once per reservation id. ARGV[1] = number of commits; then per commit
--   ARGV: rid, now_ms, dedupe_ms, tokens, micros, mode (0 reserved, 1 unreserved, 2 lease
--         settlement, 3 lease close), released_tokens, released_micros, n_counters,
--         expire_at_ms per counter, n_rates, then per rate limiter per_minute, units to give back;
--   KEYS: the commit marker (an unreserved commit sets it; a lease's reservation set it, and
--         its close removes it), (counter hash, reservation zset) per counter, one key per rate
--         limiter.
-- Reply: per commit 1 applied, 0 already committed (or nothing new).
--
-- A reserved commit is idempotent through the reservation itself: it applies to a counter that
-- still holds r:<rid> (live) or x:<rid> (expired, not yet committed) and consumes it, so a retry
-- finds neither and changes nothing. An unreserved commit (spend admitted while Redis was
-- unreachable) has no reservation and is deduplicated by a marker key instead. A lease
-- settlement carries running totals (spent, released) and applies only their growth over the
-- totals recorded in a:<rid>; a close also releases what the lease still holds and forgets it.
local function totals(v)
  local out = {0, 0, 0, 0}
  if v then
    local i = 1
    for n in string.gmatch(v, '[^:]+') do
      out[i] = tonumber(n)
      i = i + 1
    end
  end
  return out
end

local out = {}
local ka, aa = 0, 1
for c = 1, tonumber(ARGV[1]) do
  local rid = ARGV[aa + 1]
  local tokens, micros = tonumber(ARGV[aa + 4]), tonumber(ARGV[aa + 5])
  local mode = ARGV[aa + 6]
  local rel_t, rel_m = tonumber(ARGV[aa + 7]), tonumber(ARGV[aa + 8])
  local nc = tonumber(ARGV[aa + 9])
  local rb = aa + 9 + nc
  local nr = tonumber(ARGV[rb + 1])
  local applied = false
  local refund = true
  if mode == '1' then
    if redis.call('SET', KEYS[ka + 1], '1', 'NX', 'PX', ARGV[aa + 3]) then
      for i = 1, nc do
        local h = KEYS[ka + 2 * i]
        redis.call('HINCRBY', h, 'st', ARGV[aa + 4])
        redis.call('HINCRBY', h, 'sm', ARGV[aa + 5])
        redis.call('PEXPIREAT', h, ARGV[aa + 9 + i])
      end
      applied = true
    end
  elseif mode == '0' then
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
  else
    local close = mode == '3'
    -- Only the first close of a lease that existed finds its marker: its rate limiter units come
    -- back once (also for a lease of rate limits alone, which has no counter to show it).
    refund = close and redis.call('DEL', KEYS[ka + 1]) == 1
    applied = refund
    for i = 1, nc do
      local h, z = KEYS[ka + 2 * i], KEYS[ka + 2 * i + 1]
      local v = redis.call('HMGET', h, 'r:' .. rid, 'x:' .. rid, 'a:' .. rid)
      if v[1] or v[2] then
        local prev = totals(v[3])
        local now = {math.max(prev[1], tokens), math.max(prev[2], micros),
          math.max(prev[3], rel_t), math.max(prev[4], rel_m)}
        local grew = false
        for j = 1, 4 do grew = grew or now[j] > prev[j] end
        if grew or close then
          redis.call('HINCRBY', h, 'st', fmt(now[1] - prev[1]))
          redis.call('HINCRBY', h, 'sm', fmt(now[2] - prev[2]))
          if v[1] then
            local sep = string.find(v[1], ':', 1, true)
            local ht, hm = tonumber(string.sub(v[1], 1, sep - 1)), tonumber(string.sub(v[1], sep + 1))
            local gt, gm = math.min(ht, now[3] - prev[3]), math.min(hm, now[4] - prev[4])
            if close then gt, gm = ht, hm end
            for _, f in ipairs({'rt', 'lt'}) do redis.call('HINCRBY', h, f, fmt(-gt)) end
            for _, f in ipairs({'rm', 'lm'}) do redis.call('HINCRBY', h, f, fmt(-gm)) end
            if close then
              redis.call('HDEL', h, 'r:' .. rid)
              redis.call('ZREM', z, rid)
            else
              redis.call('HSET', h, 'r:' .. rid, fmt(ht - gt) .. ':' .. fmt(hm - gm))
            end
          end
          if close then
            redis.call('HDEL', h, 'x:' .. rid, 'a:' .. rid)
          else
            redis.call('HSET', h, 'a:' .. rid, fmt(now[1]) .. ':' .. fmt(now[2]) .. ':' ..
              fmt(now[3]) .. ':' .. fmt(now[4]))
          end
          applied = applied or grew
        end
      end
    end
  end
  if applied and refund then
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
  out[c] = applied and 1 or 0
  ka = ka + 1 + 2 * nc + nr
  aa = rb + 1 + 2 * nr
end
return out
