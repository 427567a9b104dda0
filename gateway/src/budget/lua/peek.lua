-- Current state of counters. KEYS: (counter hash, reservation zset) pairs. ARGV: now_ms.
local out = {}
for i = 1, #KEYS / 2 do
  local h, z = KEYS[2 * i - 1], KEYS[2 * i]
  purge(h, z, tonumber(ARGV[1]))
  local st, sm, rt, rm = state(h)
  out[#out + 1] = st
  out[#out + 1] = sm
  out[#out + 1] = rt
  out[#out + 1] = rm
end
return out
