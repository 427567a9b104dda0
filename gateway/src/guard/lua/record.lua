-- Record a request's turn in its session's window and answer the session as it was.
-- KEYS[1] state hash, KEYS[2] window list, KEYS[3] the tenant's session index (zset).
-- ARGV: now_ms, encoded turn, its request hash (8 bytes), turns kept, ttl_ms, session id,
--       offset of the flags byte (0-based).
-- (`keys` and `argv` as this says of KEYS and ARGV: the function is also run by admit.lua.)
-- Every `redis.call` costs microseconds inside a script, so the state's fields are read once
-- and written in one call, and the window itself is read only when the client needs it: the
-- state keeps what a turn is judged by (`st`: the window's steps, 8 bytes each, oldest first;
-- `rq`: the newest turn's request hash; `ra`: '1' once it was answered, set by settle.lua).
-- A session written before those fields existed has them filled from its window once.
-- The list may hold up to TRIM_SLACK turns more than are kept (it is trimmed once per that
-- many pushes, not at every push); every read takes its newest `turns`.
-- Numbers written to Redis go as the strings they came in as, or as `%d` (a Lua number turned
-- into a string otherwise goes through the C library's floating-point formatting, which costs
-- microseconds for a time in ms).
local TRIM_SLACK = 8

local function record(keys, argv)
  local now = tonumber(argv[1])
  local state = redis.call('HGETALL', keys[1])
  local at = tonumber(argv[7]) + 1
  local first, requests, blocked, refreshed = nil, 0, false, nil
  local steps, newest, answered = nil, nil, false
  -- The state as the client reads it (the judging fields stay here).
  local shown = {}
  for i = 1, #state, 2 do
    local field, value = state[i], state[i + 1]
    if field == 'st' then
      steps = value
    elseif field == 'rq' then
      newest = value
    elseif field == 'ra' then
      answered = value == '1'
    else
      shown[#shown + 1] = field
      shown[#shown + 1] = value
      if field == 'f' then
        first = value
      elseif field == 'n' then
        requests = tonumber(value)
      elseif field == 'bk' then
        blocked = true
      elseif field == 'x' then
        refreshed = tonumber(value)
      end
    end
  end
  local turns = tonumber(argv[4])
  local window = nil
  if #state > 0 and steps == nil then
    window = redis.call('LRANGE', keys[2], -turns, -1)
    local parts = {}
    for i = 1, #window do
      parts[i] = string.sub(window[i], 9, 16)
    end
    steps = table.concat(parts)
    local last = window[#window]
    if last then
      newest = string.sub(last, 17, 24)
      answered = math.floor(string.byte(last, at) / 2) % 2 == 1
    end
  end
  steps = steps or ''
  local retry = 0
  if newest == argv[3] and not answered then
    retry = 1
  end
  -- The earlier turns go back only when a loop could end at this one (Turn::may_repeat): it
  -- has a sketch, or an earlier turn is the same step. Almost every request sends none back.
  local step = string.sub(argv[2], 9, 16)
  local may_repeat = math.floor(string.byte(argv[2], at) / 4) % 2 == 1
  if not may_repeat then
    for i = 1, #steps, 8 do
      if string.sub(steps, i, i + 7) == step then
        may_repeat = true
        break
      end
    end
  end
  if may_repeat then
    window = window or redis.call('LRANGE', keys[2], -turns, -1)
    -- The newest turn's answered mark lives in the state (`ra`, set by settle.lua), not in its
    -- entry: the window goes back with it.
    local last = window[#window]
    if answered and last and math.floor(string.byte(last, at) / 2) % 2 == 0 then
      window[#window] = string.sub(last, 1, at - 1) .. string.char(string.byte(last, at) + 2)
        .. string.sub(last, at + 1)
    end
  else
    window = {}
  end
  if retry == 0 then
    if redis.call('RPUSH', keys[2], argv[2]) > turns + TRIM_SLACK then
      redis.call('LTRIM', keys[2], -turns, -1)
    end
    steps = steps .. step
    if #steps > 8 * turns then
      steps = string.sub(steps, -8 * turns)
    end
    newest, answered = argv[3], false
  end
  local ttl = tonumber(argv[5])
  -- The keys' expiry is pushed to 1.1 ttl ahead once a tenth of the ttl has passed since it
  -- last was (field `x`, by the gateways' clocks): a session lives between ttl and 1.1 ttl
  -- after its latest request (less by as much as replicas' clocks disagree), for two calls on
  -- one request in many. The tenant's index outlives each of its sessions.
  -- A blocked session keeps the block's expiry.
  local refresh = not blocked and (refreshed == nil or now - refreshed >= ttl / 10)
  local ra = answered and '1' or '0'
  local count = string.format('%d', requests + 1)
  if refresh then
    redis.call('HSET', keys[1], 'f', first or argv[1], 'l', argv[1], 'n', count, 'x', argv[1],
      'st', steps, 'rq', newest, 'ra', ra)
    local expiry = string.format('%d', math.floor(ttl * 1.1))
    redis.call('PEXPIRE', keys[1], expiry)
    redis.call('PEXPIRE', keys[2], expiry)
    redis.call('PEXPIRE', keys[3], expiry)
  else
    redis.call('HSET', keys[1], 'f', first or argv[1], 'l', argv[1], 'n', count,
      'st', steps, 'rq', newest, 'ra', ra)
  end
  -- The index grows only by a new session: that is when the ones that expired are dropped.
  if redis.call('ZADD', keys[3], argv[1], argv[6]) == 1 then
    redis.call('ZREMRANGEBYSCORE', keys[3], '-inf', string.format('%d', now - ttl))
  end
  -- The state's fields and values go back joined by NUL bytes, one string instead of one per
  -- field and value (the client parses each reply element at a cost): the shown values are
  -- decimal numbers and serde_json's text, which never holds a raw NUL.
  return {table.concat(shown, '\0'), window, retry}
end
