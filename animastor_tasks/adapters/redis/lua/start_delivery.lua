-- A job's delivery, in one atomic step: any delivery ends the dispatch's undelivered marker (the job
-- has left its queue); if the dispatch still holds the pair's queued lease, the lease becomes the running
-- job's (its TTL) and the delivery takes the dispatch's running marker unless another copy holds it.
-- KEYS[1] lease key, KEYS[2] running marker, KEYS[3] undelivered marker, KEYS[4] the book's cancel flag,
-- KEYS[5] the dispatch's metadata hash (marked delivered), KEYS[6] the holder's entry (which job its process runs), KEYS[7] the
-- holders of the holder's worker node
-- ARGV[1] dispatch id, ARGV[2] lease ttl in ms, ARGV[3] holder (worker and process), ARGV[4] running marker
-- ttl in s, ARGV[5] the holder entry's ttl in s
-- returns {lease held, delivery owned, book cancelled, when the dispatch was published (nil: unknown)}
redis.call('DEL', KEYS[3])
if redis.call('EXISTS', KEYS[5]) == 1 then
    redis.call('HSET', KEYS[5], 'delivered', '1')  -- for restore_lease.lua, whatever becomes of this delivery
end
local cancelled = redis.call('EXISTS', KEYS[4])
local dispatched_at = redis.call('HGET', KEYS[5], 'dispatched_at')
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
    return {0, 0, cancelled, dispatched_at}
end
-- The marker this holder took already is its own still: a start whose answer was lost (Redis answered, the reply
-- did not arrive), tried again by the same process, goes on as the first try would have.
if redis.call('SET', KEYS[2], ARGV[3], 'NX', 'EX', ARGV[4]) or redis.call('GET', KEYS[2]) == ARGV[3] then
    redis.call('EXPIRE', KEYS[2], ARGV[4])
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    redis.call('SET', KEYS[6], ARGV[1] .. '\n' .. KEYS[1], 'EX', ARGV[5])
    redis.call('SADD', KEYS[7], ARGV[3])
    redis.call('EXPIRE', KEYS[7], ARGV[5])
    return {1, 1, cancelled, dispatched_at}
end
-- Another copy holds the running marker: its lease is left as it is (renewed by that copy while it runs). A
-- copy whose pool process died is let go by its worker's main process (abandon_delivery.lua); one whose whole
-- worker died is let go when that worker starts again, or by the tick once its heartbeat has gone silent.
return {1, 0, cancelled, dispatched_at}
