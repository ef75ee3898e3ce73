-- Delete a lease only if this dispatch still holds it.
-- KEYS[1] lease key
-- ARGV[1] dispatch id
-- returns 1 when deleted, 0 otherwise
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
