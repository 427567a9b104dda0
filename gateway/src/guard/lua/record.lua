-- Record a request's turn in its session's window and answer the session as it was.
-- KEYS[1] state hash, KEYS[2] window list, KEYS[3] the tenant's session index (zset).
-- ARGV: now_ms, encoded turn, its request hash (8 bytes), turns kept, ttl_ms, session id,
--       offset of the flags byte (0-based).
-- (`keys` and `argv` as this says of KEYS and ARGV: the function is also run by admit.lua.)
-- Every `redis.call` costs microseconds inside a script, so the state's fields are read once
-- and written in one call.
local function record(keys, argv)
  local now = tonumber(argv[1])
  local state = redis.call('HGETALL', keys[1])
  local window = redis.call('LRANGE', keys[2], 0, -1)
  local retry = 0
  local newest = window[#window]
  if newest then
    local flags = string.byte(newest, tonumber(argv[7]) + 1)
    local answered = math.floor(flags / 2) % 2 == 1
    if string.sub(newest, 17, 24) == argv[3] and not answered then
      retry = 1
    end
  end
  local turns = tonumber(argv[4])
  if retry == 0 and redis.call('RPUSH', keys[2], argv[2]) > turns then
    redis.call('LTRIM', keys[2], -turns, -1)
  end
  local first, requests, blocked, refreshed = nil, 0, false, nil
  for i = 1, #state, 2 do
    local field = state[i]
    if field == 'f' then
      first = state[i + 1]
    elseif field == 'n' then
      requests = tonumber(state[i + 1])
    elseif field == 'bk' then
      blocked = true
    elseif field == 'x' then
      refreshed = tonumber(state[i + 1])
    end
  end
  local ttl = tonumber(argv[5])
  -- The keys' expiry is pushed to 1.1 ttl ahead once a tenth of the ttl has passed since it
  -- last was (field `x`, by the gateways' clocks): a session lives between ttl and 1.1 ttl
  -- after its latest request (less by as much as replicas' clocks disagree), for two calls on
  -- one request in many. The tenant's index outlives each of its sessions.
  -- A blocked session keeps the block's expiry.
  local refresh = not blocked and (refreshed == nil or now - refreshed >= ttl / 10)
  if refresh then
    redis.call('HSET', keys[1], 'f', first or now, 'l', now, 'n', requests + 1, 'x', now)
    local expiry = math.floor(ttl * 1.1)
    redis.call('PEXPIRE', keys[1], expiry)
    redis.call('PEXPIRE', keys[2], expiry)
    redis.call('PEXPIRE', keys[3], expiry)
  else
    redis.call('HSET', keys[1], 'f', first or now, 'l', now, 'n', requests + 1)
  end
  -- The index grows only by a new session: that is when the ones that expired are dropped.
  if redis.call('ZADD', keys[3], now, argv[6]) == 1 then
    redis.call('ZREMRANGEBYSCORE', keys[3], '-inf', now - ttl)
  end
  -- The earlier turns go back only when a loop could end at this one (Turn::may_repeat): it
  -- has a sketch, or an earlier turn is the same step. Almost every request sends none back.
  local sketched = math.floor(string.byte(argv[2], tonumber(argv[7]) + 1) / 4) % 2 == 1
  if not sketched then
    local step = string.sub(argv[2], 9, 16)
    local same = false
    for i = 1, #window do
      if string.sub(window[i], 9, 16) == step then
        same = true
        break
      end
    end
    if not same then
      window = {}
    end
  end
  return {state, window, retry}
end
