-- Record the result of one publish or one job run for the circuit breaker of one queue.
-- KEYS[1] breaker hash (fields: failures, open_until, permit_until, cause)
-- ARGV[1] 'ok' or 'fail', ARGV[2] now, ARGV[3] failure threshold, ARGV[4] cool-down seconds,
-- ARGV[5] what the result is of: 'publish' or 'run'
-- returns the state after recording: 'closed' or 'open', 'reopened' when this failure found it open already
-- (the half-open test failed, or a job of the outage that opened it), or 'recovered' when this success closed
-- a breaker that was open (its lane's waiting work may go now)
-- A successful publish does not clear failures that jobs' runs recorded: only a job that runs
-- well proves the inference backend is back (else every replacement publish would hide them).
local open_until = tonumber(redis.call('HGET', KEYS[1], 'open_until') or '0')
if ARGV[1] == 'ok' then
    if ARGV[5] == 'publish' and redis.call('HGET', KEYS[1], 'cause') == 'run' then
        if open_until > 0 then
            return 'open'
        end
        return 'closed'
    end
    redis.call('DEL', KEYS[1])
    if open_until > 0 then
        return 'recovered'
    end
    return 'closed'
end
local failures = redis.call('HINCRBY', KEYS[1], 'failures', 1)
redis.call('HSET', KEYS[1], 'cause', ARGV[5])
if failures >= tonumber(ARGV[3]) or open_until > 0 then
    redis.call('HSET', KEYS[1], 'open_until', tostring(tonumber(ARGV[2]) + tonumber(ARGV[4])), 'permit_until', '0')
    if open_until > 0 then
        return 'reopened'
    end
    return 'open'
end
return 'closed'
