-- The guard step of a request in one round trip: the tenant's settles this gateway queued
-- (settle_all, KEYS from ARGV[12] on, ARGV[13..]) applied first, so a turn answered moments
-- ago is seen answered; then the request's turn recorded in its session's window (record,
-- KEYS[1..3], ARGV[1..7]) and the request counted in its tenant's retry budget (retries,
-- KEYS[4] and, when ARGV[12] is 6, KEYS[5]; ARGV[8..11]). Every key carries the tenant's hash
-- tag: one slot. Answers both in one string (below).
local first_settle = tonumber(ARGV[12])
settle_all(KEYS, first_settle, ARGV, 13, tonumber(ARGV[7]) + 1)
local retry_keys = {KEYS[4]}
if first_settle == 6 then
  retry_keys[2] = KEYS[5]
end
local seen = record({KEYS[1], KEYS[2], KEYS[3]}, {ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7]})
local counts = retries(retry_keys, {ARGV[8], ARGV[9], ARGV[10], ARGV[11]})
-- One string (the client parses each element of a reply at a cost): a line of five numbers
-- (record's retry, retries' requests, retries and after-error, the state's length), the state
-- (record's NUL-joined fields and values), then the window's turns (each of one fixed size).
return string.format('%d %d %d %d %d\n', seen[3], counts[1], counts[2], counts[3], #seen[1])
  .. seen[1] .. table.concat(seen[2])
