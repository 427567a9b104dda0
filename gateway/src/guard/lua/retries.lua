-- Count one request of a tenant (and a retry, when ARGV[2] = 1, or when ARGV[2] = failed and
-- KEYS[2] exists: the same request got an error answer lately) in bucket ARGV[1] of its
-- retry-budget hash, and answer {requests, retries, after_error} over the window of the last
-- ARGV[3] buckets.
-- KEYS[1]: the tenant's hash ({g:t}:rt): `s` the newest bucket counted, `N` and `R` the totals
--   over the window ending at it, `n<bucket>` and `r<bucket>` each bucket's counts in the window,
--   `fx` when the latest of the tenant's error marks expires (Redis's clock, ms; see
--   mark_failed.lua).
-- KEYS[2] (with ARGV[2] = failed): the mark of an error answer ({g:t}:failed:<key>:<fp>).
-- ARGV: bucket, retry (1|failed), buckets in the window, ttl ms (the window's length).
-- (`keys` and `argv` as this says of KEYS and ARGV: the function is also run by admit.lua.)
--
-- The totals are kept as they change, so a request reads and writes five fields in one call
-- each; only the first request of a new bucket reads and drops the buckets that left the window
-- and pushes the hash's expiry (to 1.1 windows ahead, or to its latest error mark's end if that
-- is later: the hash outlives the tenant's latest request by a window and its marks' `fx`).
-- Numbers go to Redis as `%d` strings (see record.lua).
-- The error mark is looked for only while one may be live (`fx`): every `redis.call` costs
-- microseconds inside a script. A request whose bucket is older than the newest (a replica's
-- clock behind another's) counts into its own bucket while that is in the window, and is
-- answered the window ending at the newest.
-- The fields of buckets `from` to `to`: n<bucket> and r<bucket> of each, in that order.
local function bucket_fields(from, to)
  local fields = {}
  for s = from, to do
    fields[#fields + 1] = 'n' .. s
    fields[#fields + 1] = 'r' .. s
  end
  return fields
end

local function retries(keys, argv)
  local slot = tonumber(argv[1])
  local buckets = tonumber(argv[3])
  local nf, rf = 'n' .. slot, 'r' .. slot
  local got = redis.call('HMGET', keys[1], 's', 'N', 'R', nf, rf, 'fx')
  local last = tonumber(got[1])
  local n, r = tonumber(got[2] or '0'), tonumber(got[3] or '0')
  local bn, br = tonumber(got[4] or '0'), tonumber(got[5] or '0')
  local marks_until = tonumber(got[6])
  local after_error = 0
  if argv[2] == 'failed' and marks_until and redis.call('EXISTS', keys[2]) == 1 then
    after_error = 1
  end
  local retry = (argv[2] == '1' or after_error == 1) and 1 or 0
  local gone = nil
  if last == nil or slot - last >= buckets then
    -- A new window: everything counted before left it.
    gone = {}
    if last ~= nil then
      gone = bucket_fields(last - buckets + 1, last)
    end
    last, n, r, bn, br = slot, 0, 0, 0, 0
  elseif slot > last then
    -- The window moves on: drop the buckets that left it from the totals.
    gone = bucket_fields(last - buckets + 1, slot - buckets)
    local old = redis.call('HMGET', keys[1], unpack(gone))
    for i = 1, #old, 2 do
      n = n - tonumber(old[i] or '0')
      r = r - tonumber(old[i + 1] or '0')
    end
    last = slot
  end
  if slot > last - buckets then
    n, r, bn, br = n + 1, r + retry, bn + 1, br + retry
    local d = string.format
    redis.call('HSET', keys[1], 's', d('%d', last), 'N', d('%d', n), 'R', d('%d', r),
      nf, d('%d', bn), rf, d('%d', br))
  end
  if gone then
    -- A new bucket: once per bucket, not per request.
    local expiry = math.floor(tonumber(argv[4]) * 1.1)
    if marks_until then
      local t = redis.call('TIME')
      local left = marks_until - (tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
      if left <= 0 then
        gone[#gone + 1] = 'fx'
      elseif left > expiry then
        expiry = left
      end
    end
    if #gone > 0 then
      redis.call('HDEL', keys[1], unpack(gone))
    end
    redis.call('PEXPIRE', keys[1], string.format('%d', expiry))
  end
  return {n, r, after_error}
end
