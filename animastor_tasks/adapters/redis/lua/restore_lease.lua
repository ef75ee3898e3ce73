-- Restore the queued lease of a job reconcile saw waiting in its queue: taken if nobody holds it, extended if
-- this dispatch does, left alone if another dispatch does -- and never once the job was delivered. A job that
-- started between reconcile's look at the queue and this step holds its own lease (the stage's TTL, renewed
-- by its watcher); stretched to a queued lease's day, a worker that died early kept its pair for that day.
-- KEYS[1] lease key, KEYS[2] the dispatch's running marker (set by its delivery)
-- ARGV[1] dispatch id, ARGV[2] ttl in milliseconds
-- returns 1 when the lease was taken or extended, 0 otherwise
if redis.call('EXISTS', KEYS[2]) == 1 then
    return 0
end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
    return 1
end
if redis.call('GET', KEYS[1]) == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return 1
end
return 0
