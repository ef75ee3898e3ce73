-- Lift a book's cancel flag only while it holds the value ARGV[1], so that a flag of the other kind written since
-- stays. Lifting a mirror of a tombstone: a Stop All's own flag, set since the caller read the tombstones, stays (its
-- Postgres half may have failed: the flag alone stops the book). Lifting a Stop All's own, of a book Postgres does
-- not hold: a mirror written since (of a tombstone) stays.
-- KEYS[1] the cancel flag
-- returns 1 when lifted
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
