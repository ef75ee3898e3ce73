-- Ask the circuit breaker of one queue for permission to publish.
-- KEYS[1] breaker hash (fields: failures, open_until, permit_until)
-- ARGV[1] now (seconds, float), ARGV[2] permit lease seconds, ARGV[3] the permit's expiry as stored
--   (now + lease, formatted by the caller, who gives the permit back with it: breaker_release.lua)
-- returns 'closed' (go), 'permit' (the one half-open test permit), or 'open' (refuse)
local open_until = tonumber(redis.call('HGET', KEYS[1], 'open_until') or '0')
if open_until == 0 then
    return 'closed'
end
local now = tonumber(ARGV[1])
if now < open_until then
    return 'open'
end
local permit_until = tonumber(redis.call('HGET', KEYS[1], 'permit_until') or '0')
if permit_until > now then
    return 'open'
end
redis.call('HSET', KEYS[1], 'permit_until', ARGV[3])
return 'permit'
