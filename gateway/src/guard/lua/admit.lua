-- The guard step of a request in one round trip: its turn recorded in its session's window
-- (record, KEYS[1..3], ARGV[1..7]) and the request counted in its tenant's retry budget
-- (retries, KEYS[4..5], ARGV[8..11]). Every key carries the tenant's hash tag: one slot.
-- Answers {record's answer, retries' answer}.
return {
  record({KEYS[1], KEYS[2], KEYS[3]}, {ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7]}),
  retries({KEYS[4], KEYS[5]}, {ARGV[8], ARGV[9], ARGV[10], ARGV[11]}),
}
