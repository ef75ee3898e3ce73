-- A dispatch a forced regenerate fenced off, judged and acted on in one step, only while it holds the pair's
-- lease: running (its delivery's marker is there), its lease is swapped for its stop marker, so it stops at its
-- next renewal and the pair keeps its slot until it has returned; still queued, its lease and undelivered
-- marker go, so the tick takes the pair over at once. Read first and written after, a job that ended in
-- between had the marker set after its end released it, and nothing released it again (a lease TTL idle).
-- Either way the dispatch is remembered as superseded, so that the takeover gives its pair's slot to the re-run.
-- KEYS[1] lease key, KEYS[2] the dispatch's running marker, KEYS[3] its undelivered marker, KEYS[4] its superseded
-- record
-- ARGV[1] dispatch id, ARGV[2] its stop marker, ARGV[3] the marker's ttl in milliseconds, ARGV[4] the record's
-- ttl in milliseconds
-- returns 1 when told to stop, 2 when withdrawn, 0 when the lease is not its own
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
    return 0
end
redis.call('SET', KEYS[4], '1', 'PX', ARGV[4])
if redis.call('EXISTS', KEYS[2]) == 1 then
    redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
    return 1
end
redis.call('DEL', KEYS[1], KEYS[3])
return 2
