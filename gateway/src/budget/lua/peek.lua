-- Current state of counters. KEYS: (counter hash, reservation zset) pairs. ARGV: now_ms.
local out = {}
for i = 1, #KEYS / 2 do
  local h, z = KEYS[2 * i - 1], KEYS[2 * i]
  purge(h, z, tonumber(ARGV[1]))
  local st, sm, rt, rm, lt, lm = state(h)
  for _, x in ipairs({st, sm, rt, rm, lt, lm}) do out[#out + 1] = x end
end
return out
