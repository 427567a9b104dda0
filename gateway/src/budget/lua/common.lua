-- Shared helpers, prepended to every budget script (see redis.rs). Counters are hashes with
-- fields st/sm (spent tokens/micro-dollars), rt/rm (reserved), r:<rid> = "<tokens>:<micros>" per
-- live reservation and x:<rid> per expired one not yet committed; a sorted set next to each
-- counter holds live reservation ids by expiry. Leases (rids starting with `lease:`) are also
-- totalled in lt/lm, and a:<rid> = "<spent t>:<spent m>:<released t>:<released m>" holds the
-- running totals of a lease's settlements applied so far.
-- Numbers go to Redis as integer strings (Lua would print 1000 as 1e+03, and -0 as "-0").
local function fmt(x)
  if x == 0 then return '0' end
  return string.format('%.0f', x)
end

-- Give back what reservation `rid` holds on counter `h` (if it is still live).
local function release(h, rid)
  local v = redis.call('HGET', h, 'r:' .. rid)
  if v then
    local sep = string.find(v, ':', 1, true)
    local t, m = fmt(-tonumber(string.sub(v, 1, sep - 1))), fmt(-tonumber(string.sub(v, sep + 1)))
    redis.call('HINCRBY', h, 'rt', t)
    redis.call('HINCRBY', h, 'rm', m)
    if string.sub(rid, 1, 6) == 'lease:' then
      redis.call('HINCRBY', h, 'lt', t)
      redis.call('HINCRBY', h, 'lm', m)
    end
    redis.call('HDEL', h, 'r:' .. rid)
  end
end

-- Release expired reservations, leaving an x:<rid> marker so a late commit still counts once.
local function purge(h, z, now)
  local expired = redis.call('ZRANGEBYSCORE', z, '-inf', now)
  for _, rid in ipairs(expired) do
    release(h, rid)
    redis.call('HSET', h, 'x:' .. rid, '1')
  end
  if #expired > 0 then
    redis.call('ZREMRANGEBYSCORE', z, '-inf', now)
  end
end

-- A counter's totals (spent, reserved, of which lease-held), until when it takes no new lease
-- (lq, ms), whether it exists, and whether it was seeded from the ledger (sd).
local function state(h)
  local v = redis.call('HMGET', h, 'st', 'sm', 'rt', 'rm', 'lt', 'lm', 'lq', 'sd')
  return tonumber(v[1]) or 0, tonumber(v[2]) or 0, tonumber(v[3]) or 0, tonumber(v[4]) or 0,
    tonumber(v[5]) or 0, tonumber(v[6]) or 0, tonumber(v[7]) or 0,
    (v[1] or v[2] or v[3] or v[4]) ~= false, v[8] ~= false
end
