-- Requests settled, in a batch: a gateway queues its settles for a few milliseconds and sends
-- them with the tenant's next turn (admit.lua) or on their own (this script's body below).
-- `settle(state, window, hash, ok, cost, at)`: one request settled. `state` the session's hash,
-- `window` its list, `hash` the request's hash (8 bytes), `ok` '1' when answered (2xx), `cost`
-- micros, `at` the flags byte's 1-based offset in an encoded turn.
-- The state and the window are written and expire together, so a session without turns has
-- expired or was cleared: nothing is recreated.
-- The turn settled is nearly always the newest, so that one is read alone (`LINDEX`): every
-- `redis.call` costs microseconds inside a script, and the whole window's copy most of all.
local function settle(state, window, hash, ok, cost, at)
  local newest = redis.call('LINDEX', window, -1)
  if not newest then
    return 0
  end
  if ok == '1' then
    local function answer(t, index)
      local flags = string.byte(t, at)
      if math.floor(flags / 2) % 2 == 0 then
        flags = flags + 2
        redis.call('LSET', window, index, string.sub(t, 1, at - 1) .. string.char(flags) .. string.sub(t, at + 1))
      end
    end
    if string.sub(newest, 17, 24) == hash then
      answer(newest, -1)
      -- The state's note of the newest turn (record.lua's `ra`).
      redis.call('HSET', state, 'lc', cost, 'ra', '1')
    else
      local turns = redis.call('LRANGE', window, 0, -1)
      for i = #turns - 1, 1, -1 do
        if string.sub(turns[i], 17, 24) == hash then
          answer(turns[i], i - 1)
          break
        end
      end
      redis.call('HSET', state, 'lc', cost)
    end
  end
  redis.call('HINCRBY', state, 'c', tonumber(cost))
  return 1
end

-- The settles in `keys` from `k` on (two keys each: state, window) and `argv` from `a` on
-- (three each: hash, ok, cost); `at` as settle's. Answers how many found their session.
local function settle_all(keys, k, argv, a, at)
  local found = 0
  while keys[k] do
    found = found + settle(keys[k], keys[k + 1], argv[a], argv[a + 1], argv[a + 2], at)
    k, a = k + 2, a + 3
  end
  return found
end
