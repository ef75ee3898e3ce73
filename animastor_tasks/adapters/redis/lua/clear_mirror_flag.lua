-- Lift a book's cancel flag only while it mirrors a tombstone (value ARGV[1]): a Stop All's own flag, set since
-- the caller read the tombstones, stays (its Postgres half may have failed: the flag alone stops the book).
-- KEYS[1] the cancel flag
-- returns 1 when lifted
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
