-- A request settled. KEYS[1] state hash, KEYS[2] window list.
-- ARGV: request hash (8 bytes), ok (0/1), cost micros, offset of the flags byte (0-based).
-- The state and the window are written and expire together, so a session without turns has
-- expired or was cleared: nothing is recreated.
local window = redis.call('LRANGE', KEYS[2], 0, -1)
if #window == 0 then
  return 0
end
if ARGV[2] == '1' then
  local at = tonumber(ARGV[4]) + 1
  for i = #window, 1, -1 do
    local t = window[i]
    if string.sub(t, 17, 24) == ARGV[1] then
      local flags = string.byte(t, at)
      if math.floor(flags / 2) % 2 == 0 then
        flags = flags + 2
        local updated = string.sub(t, 1, at - 1) .. string.char(flags) .. string.sub(t, at + 1)
        redis.call('LSET', KEYS[2], i - 1, updated)
      end
      break
    end
  end
  redis.call('HSET', KEYS[1], 'lc', ARGV[3])
end
redis.call('HINCRBY', KEYS[1], 'c', tonumber(ARGV[3]))
return 1
