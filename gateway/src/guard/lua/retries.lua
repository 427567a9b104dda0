-- Count one request of a tenant (and a retry, when ARGV[2] = 1, or when ARGV[2] = failed and
-- KEYS[2] exists: the same request got an error answer lately) in bucket ARGV[1] of its
-- retry-budget hash, and answer {requests, retries, after_error} over the last ARGV[3] buckets.
-- KEYS[1]: the tenant's hash ({g:t}:rb): fields n<bucket> and r<bucket>.
-- KEYS[2] (with ARGV[2] = failed): the mark of an error answer ({g:t}:failed:<key>:<fp>).
-- ARGV: bucket, retry (1|failed), buckets in the window, ttl ms.
local slot = tonumber(ARGV[1])
local buckets = tonumber(ARGV[3])
local after_error = 0
if ARGV[2] == 'failed' and redis.call('EXISTS', KEYS[2]) == 1 then
  after_error = 1
end
redis.call('HINCRBY', KEYS[1], 'n' .. slot, 1)
if ARGV[2] == '1' or after_error == 1 then
  redis.call('HINCRBY', KEYS[1], 'r' .. slot, 1)
end
-- The window's buckets in one HMGET, and those that left it in one HDEL: two calls instead of
-- three per bucket (this runs on every request of a tenant).
local inside, outside = {}, {}
for s = slot - buckets + 1, slot do
  inside[#inside + 1] = 'n' .. s
  inside[#inside + 1] = 'r' .. s
  outside[#outside + 1] = 'n' .. (s - buckets)
  outside[#outside + 1] = 'r' .. (s - buckets)
end
local got = redis.call('HMGET', KEYS[1], unpack(inside))
local n, r = 0, 0
for i = 1, #got, 2 do
  n = n + tonumber(got[i] or '0')
  r = r + tonumber(got[i + 1] or '0')
end
redis.call('HDEL', KEYS[1], unpack(outside))
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return {n, r, after_error}
