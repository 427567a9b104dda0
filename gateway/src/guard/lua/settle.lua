-- Requests settled, in a batch: a gateway queues its settles for a few milliseconds and sends
-- them with the tenant's next turn (admit.lua) or on their own (this script's body below).
-- `settle(state, window, hash, ok, cost, at)`: one request settled. `state` the session's hash,
-- `window` its list, `hash` the request's hash (8 bytes), `ok` '1' when answered (2xx), `cost`
-- micros, `at` the flags byte's 1-based offset in an encoded turn.
-- The state and the window are written and expire together, so a session without turns has
-- expired or was cleared: nothing is recreated.
-- Only the newest turn's answered mark is ever read (a request identical to the newest turn and
-- sent before it was answered is a retry; an older turn cannot become the newest again), and
-- record.lua keeps it in the state (`rq` the newest turn's request hash, `ra` its mark), so a
-- settle reads and writes the state alone: one `HMGET` and one `HSET` (every `redis.call` costs
-- microseconds inside a script). The cost total is summed here and written back as `%d`.
-- A session written before the state kept `rq` is settled in its window, as it was then.
local function settle_in_window(state, window, hash, ok, cost, at)
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
    else
      local turns = redis.call('LRANGE', window, 0, -1)
      for i = #turns - 1, 1, -1 do
        if string.sub(turns[i], 17, 24) == hash then
          answer(turns[i], i - 1)
          break
        end
      end
    end
    redis.call('HSET', state, 'lc', cost)
  end
  redis.call('HINCRBY', state, 'c', tonumber(cost))
  return 1
end

local function settle(state, window, hash, ok, cost, at)
  local got = redis.call('HMGET', state, 'n', 'rq', 'c')
  if not got[1] then
    return 0
  end
  if not got[2] then
    return settle_in_window(state, window, hash, ok, cost, at)
  end
  local total = string.format('%d', tonumber(got[3] or '0') + tonumber(cost))
  if ok ~= '1' then
    redis.call('HSET', state, 'c', total)
  elseif got[2] == hash then
    redis.call('HSET', state, 'c', total, 'lc', cost, 'ra', '1')
  else
    redis.call('HSET', state, 'c', total, 'lc', cost)
  end
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
