-- A consumer stops consuming a queue: its heartbeat entry goes, and if that leaves the queue without a live
-- consumer, when it was left so is noted (a restart's successor is waited for that long before the stage is
-- BLOCKED). Noted also beside a worker still live, a later death of that one was waited out as a restart.
-- KEYS[1] the queue's consumers (hostname -> heartbeat expiry), KEYS[2] departures (queue -> when)
-- ARGV[1] hostname, ARGV[2] now (the server's clock, seconds), ARGV[3] queue
redis.call('ZREM', KEYS[1], ARGV[1])
if redis.call('ZCOUNT', KEYS[1], '(' .. ARGV[2], '+inf') == 0 then
    redis.call('ZADD', KEYS[2], ARGV[2], ARGV[3])
end
return 0
