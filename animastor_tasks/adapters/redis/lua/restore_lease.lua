-- Restore the queued lease of a job reconcile saw waiting in its queue: taken if nobody holds it, extended if
-- this dispatch does, left alone if another dispatch does -- and never once the job was delivered. A job that
-- started between reconcile's look at the queue and this step holds its own lease (the stage's TTL, renewed
-- by its watcher); stretched to a queued lease's day, a worker that died early kept its pair for that day. A
-- delivery marks the dispatch's metadata (start_delivery.lua): one whose process died since, its running
-- marker and lease let go, would otherwise take a day-long lease nothing ends. (Lost with Redis's data, the
-- mark goes with the lease it was to guard: the restore then takes the lease, as it must.)
-- Nor for a dispatch whose token is not the pair's any more (a forced regenerate fenced it off while it was
-- queued and withdrew its lease): its revoked message is dropped unrun, and nothing would end that lease.
-- KEYS[1] lease key, KEYS[2] the dispatch's running marker (set by its delivery), KEYS[3] its metadata (field
-- `delivered`: set by its first delivery)
-- ARGV[1] dispatch id, ARGV[2] ttl in milliseconds, ARGV[3] the pair's fencing token in Postgres
-- returns 1 when the lease was taken or extended, -1 when the dispatch was superseded, 0 otherwise
if redis.call('EXISTS', KEYS[2]) == 1 or redis.call('HGET', KEYS[3], 'delivered') then
    return 0
end
local token = redis.call('HGET', KEYS[3], 'token')
if token and token ~= ARGV[3] then
    return -1
end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
    return 1
end
if redis.call('GET', KEYS[1]) == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return 1
end
return 0
