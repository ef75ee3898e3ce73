-- Record the result of one publish or one job run for the circuit breaker of one queue.
-- KEYS[1] breaker hash (fields: failures, open_until, permit_until, cause)
-- KEYS[2] (a run's only) the streak of failed runs of the worker node that ran it, on this queue
-- ARGV[1] 'ok' or 'fail', ARGV[2] now, ARGV[3] failure threshold, ARGV[4] cool-down seconds,
-- ARGV[5] what the result is of: 'publish' or 'run', ARGV[6] (with KEYS[2]) how long a streak outlives its last failure
-- returns {state, streak}: the state after recording: 'closed' or 'open', 'reopened' when this failure found it open
-- already (the half-open test failed, or a job of the outage that opened it), 'recovered' when this success closed
-- a breaker that was open (its lane's waiting work may go now), or 'host' when the breaker stays closed but this
-- run's node has failed its last threshold runs or more (its own backend is wrong while other nodes' runs succeed);
-- and the node's streak after it (0 without KEYS[2]), whatever the state: a node at the threshold whose failure
-- opened the breaker is as sick as one told 'host'.
-- A successful publish does not clear failures that jobs' runs recorded: only a job that runs
-- well proves the inference backend is back (else every replacement publish would hide them).
local open_until = tonumber(redis.call('HGET', KEYS[1], 'open_until') or '0')
if ARGV[1] == 'ok' then
    if KEYS[2] then
        redis.call('DEL', KEYS[2])
    end
    if ARGV[5] == 'publish' and redis.call('HGET', KEYS[1], 'cause') == 'run' then
        if open_until > 0 then
            return {'open', 0}
        end
        return {'closed', 0}
    end
    redis.call('DEL', KEYS[1])
    if open_until > 0 then
        return {'recovered', 0}
    end
    return {'closed', 0}
end
local streak = 0
if KEYS[2] then
    streak = redis.call('INCR', KEYS[2])
    redis.call('EXPIRE', KEYS[2], ARGV[6])
end
local failures = redis.call('HINCRBY', KEYS[1], 'failures', 1)
redis.call('HSET', KEYS[1], 'cause', ARGV[5])
if failures >= tonumber(ARGV[3]) or open_until > 0 then
    redis.call('HSET', KEYS[1], 'open_until', tostring(tonumber(ARGV[2]) + tonumber(ARGV[4])), 'permit_until', '0')
    if open_until > 0 then
        return {'reopened', streak}
    end
    return {'open', streak}
end
if streak >= tonumber(ARGV[3]) then
    return {'host', streak}
end
return {'closed', streak}
