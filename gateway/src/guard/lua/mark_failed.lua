-- An error answer to a request, marked. KEYS[1] the mark ({g:t}:failed:<key>:<fp>), KEYS[2] the
-- tenant's retry-budget hash ({g:t}:rt, see retries.lua). ARGV[1]: how long the mark lasts, ms.
-- The hash's `fx` says until when the tenant's latest mark lasts (Redis's clock), so that a
-- request is looked up among the marks only while one may be live, and the hash is kept at
-- least that long.
local ttl = tonumber(ARGV[1])
redis.call('SET', KEYS[1], 1, 'PX', ttl)
local t = redis.call('TIME')
local ends = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + ttl
if ends > tonumber(redis.call('HGET', KEYS[2], 'fx') or '0') then
  redis.call('HSET', KEYS[2], 'fx', string.format('%.0f', ends))
end
if redis.call('PTTL', KEYS[2]) < ttl then
  redis.call('PEXPIRE', KEYS[2], ttl)
end
return 1
