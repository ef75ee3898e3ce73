-- Give back a half-open test permit that was not used (its pairs were complete or had no room),
-- so the next pass may test the queue at once instead of after the permit's lease.
-- KEYS[1] breaker hash
-- ARGV[1] the permit_until value the permit was handed out with (only that permit is given back)
-- returns 1 when the permit was given back, 0 when it had expired or been replaced
if redis.call('HGET', KEYS[1], 'permit_until') == ARGV[1] then
    redis.call('HSET', KEYS[1], 'permit_until', '0')
    return 1
end
return 0
