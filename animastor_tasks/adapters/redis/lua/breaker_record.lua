-- Record the result of one publish for the circuit breaker of one queue.
-- KEYS[1] breaker hash
-- ARGV[1] 'ok' or 'fail', ARGV[2] now, ARGV[3] failure threshold, ARGV[4] cool-down seconds
-- returns the state after recording: 'closed' or 'open'
if ARGV[1] == 'ok' then
    redis.call('DEL', KEYS[1])
    return 'closed'
end
local failures = redis.call('HINCRBY', KEYS[1], 'failures', 1)
local open_until = tonumber(redis.call('HGET', KEYS[1], 'open_until') or '0')
if failures >= tonumber(ARGV[3]) or open_until > 0 then
    redis.call('HSET', KEYS[1], 'open_until', tostring(tonumber(ARGV[2]) + tonumber(ARGV[4])), 'permit_until', '0')
    return 'open'
end
return 'closed'
