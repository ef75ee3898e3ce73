-- Renew a lease only while it is still held by this dispatch.
-- KEYS[1] lease key
-- ARGV[1] dispatch id, ARGV[2] ttl in milliseconds
-- returns 1 when renewed, 0 when the lease is gone or held by another dispatch
if redis.call('GET', KEYS[1]) == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return 1
end
return 0
