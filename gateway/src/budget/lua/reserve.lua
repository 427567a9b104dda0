-- Check-and-reserve, atomically. KEYS: (counter hash, reservation zset) per counter, then one key
-- per rate limiter. ARGV: now_ms, ttl_ms, rid, prompt_tokens, prompt_micros,
-- output_micros_per_token, max_tokens, min_tokens, downgraded, units (what a requests limiter is
-- charged), lease (1: a replica's lease: counted as lease-held, refused while a counter is quiet,
-- and marked by the extra last key), quiet_ms (a refusal by a counter that leases hold room of
-- makes it take no new lease for this long), seeded_only (1: refuse with status 4 on a counter
-- not seeded from the ledger), n_counters, then per counter
-- mode (0 enforce, 1 downgrade, 2 count), limit_tokens, limit_micros, hard_tokens, hard_micros,
-- expire_at_ms (-1 = no limit), then n_rates, then per limiter per_minute, kind (0 requests,
-- 1 tokens). Reply: {0, granted, 0, states...} admitted; {1, index, 0, states...} rejected;
-- {2, index, 0} downgrade; {3, index, retry_after_ms} rate limited; {4, index, 0} counter not
-- seeded (indexes 0-based). States are
-- six numbers per counter: spent t/m, reserved t/m, lease-held t/m; an admission then also gives
-- each limiter's room left (units it would still admit now).
local now = tonumber(ARGV[1])
local ttl = tonumber(ARGV[2])
local rid = ARGV[3]
local P = tonumber(ARGV[4])
local pm = tonumber(ARGV[5])
local opt = tonumber(ARGV[6])
local M = tonumber(ARGV[7])
local min = math.min(tonumber(ARGV[8]), M)
local downgraded = ARGV[9] == '1'
local units = tonumber(ARGV[10])
local lease = ARGV[11] == '1'
local quiet = tonumber(ARGV[12])
local seeded_only = ARGV[13] == '1'
local nc = tonumber(ARGV[14])
local base = 14

local function fits(st, sm, rt, rm, ltok, lmic)
  local m = M
  if ltok >= 0 then
    local left = ltok - st - rt - P
    if left < 0 then return nil end
    if left < m then m = left end
  end
  if lmic >= 0 then
    local left = lmic - sm - rm - pm
    if left < 0 then return nil end
    if opt > 0 then
      local by_cost = math.floor(left / opt)
      while by_cost > 0 and math.ceil(by_cost * opt) > left do by_cost = by_cost - 1 end
      if by_cost < m then m = by_cost end
    end
  end
  return m
end

local states = {}
local fresh = {}
local granted = M
for i = 1, nc do
  local h, z = KEYS[2 * i - 1], KEYS[2 * i]
  local st, sm, rt, rm, lt, lm, lq, exists, seeded = state(h)
  if seeded_only and not seeded then
    return {4, i - 1, 0}
  end
  purge(h, z, now)
  st, sm, rt, rm, lt, lm, lq, exists = state(h)
  states[i] = {st, sm, rt, rm, lt, lm, lq}
  fresh[i] = not exists
end
local function flat(head)
  for i = 1, nc do
    for j = 1, 6 do head[#head + 1] = states[i][j] end
  end
  return head
end
if lease then
  for i = 1, nc do
    if states[i][7] > now then return flat({1, i - 1, 0}) end
  end
end
for i = 1, nc do
  local a = base + 6 * (i - 1)
  local mode = tonumber(ARGV[a + 1])
  local s = states[i]
  local allowed = 'skip'
  if mode == 0 then
    allowed = fits(s[1], s[2], s[3], s[4], tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]))
  elseif mode == 1 and not downgraded then
    if fits(s[1], s[2], s[3], s[4], tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])) ~= M then
      return {2, i - 1, 0}
    end
  elseif mode == 1 then
    allowed = fits(s[1], s[2], s[3], s[4], tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5]))
  end
  if allowed ~= 'skip' then
    if allowed == nil or allowed < min then
      if not lease and quiet > 0 and (s[5] > 0 or s[6] > 0) then
        redis.call('HSET', KEYS[2 * i - 1], 'lq', fmt(now + quiet))
      end
      return flat({1, i - 1, 0})
    end
    if allowed < granted then granted = allowed end
  end
end

local rbase = base + 6 * nc
local nr = tonumber(ARGV[rbase + 1])
local burst = 60000000
for j = 1, nr do
  local per_minute = tonumber(ARGV[rbase + 2 * j])
  local kind = ARGV[rbase + 2 * j + 1]
  if kind == '1' then
    local room = per_minute - P
    if room < 0 then room = 0 end
    if room < min then return {3, j - 1, 60000} end
    if room < granted then granted = room end
  end
end
local now_us = now * 1000
local tats = {}
for j = 1, nr do
  local per_minute = tonumber(ARGV[rbase + 2 * j])
  local kind = ARGV[rbase + 2 * j + 1]
  local cost = units
  if kind == '1' then cost = P + granted end
  local tat = tonumber(redis.call('GET', KEYS[2 * nc + j])) or now_us
  if tat < now_us then tat = now_us end
  local new_tat = tat + cost * (60000000 / math.max(per_minute, 1))
  if new_tat - now_us > burst then
    return {3, j - 1, math.ceil((new_tat - now_us - burst) / 1000)}
  end
  tats[j] = new_tat
end
local rooms = {}
for j = 1, nr do
  local expire = math.ceil(tats[j] / 1000) + 1000
  redis.call('SET', KEYS[2 * nc + j], fmt(tats[j]), 'PXAT', fmt(expire))
  local per_minute = tonumber(ARGV[rbase + 2 * j])
  rooms[j] = math.floor((burst - (tats[j] - now_us)) / (60000000 / math.max(per_minute, 1)))
end
if lease then
  redis.call('SET', KEYS[2 * nc + nr + 1], 'lease', 'PX', fmt(ttl))
end

local tokens = P + granted
local micros = pm + math.ceil(granted * opt)
for i = 1, nc do
  local a = base + 6 * (i - 1)
  local h, z = KEYS[2 * i - 1], KEYS[2 * i]
  local s = states[i]
  s[3] = s[3] + tokens
  s[4] = s[4] + micros
  -- Absolute values: the state was read in this same atomic script.
  redis.call('HSET', h, 'rt', fmt(s[3]), 'rm', fmt(s[4]), 'r:' .. rid, fmt(tokens) .. ':' .. fmt(micros))
  if lease then
    s[5] = s[5] + tokens
    s[6] = s[6] + micros
    redis.call('HSET', h, 'lt', fmt(s[5]), 'lm', fmt(s[6]))
  end
  redis.call('ZADD', z, fmt(now + ttl), rid)
  local expire = ARGV[a + 6]
  if fresh[i] then
    redis.call('PEXPIREAT', h, expire)
  end
  redis.call('PEXPIREAT', z, expire)
end
local out = flat({0, granted, 0})
for j = 1, nr do out[#out + 1] = rooms[j] end
return out
