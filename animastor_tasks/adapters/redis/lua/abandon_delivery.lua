-- The job a worker process held when it died, each step only while still that process's job's. Its running
-- marker goes. If the broker delivers its message again, its lease becomes a queued lease again, with its
-- undelivered marker, as a job waiting in its queue holds (the message goes back behind any backlog, where
-- nothing renews a running lease); else its lease (or the stop marker a fenced job holds) goes too, so the tick
-- takes the pair over now rather than once the lease lapses.
-- KEYS[1] the dispatch's running marker, KEYS[2] the pair's lease, KEYS[3] the holder's entry,
-- KEYS[4] the dispatch's undelivered marker
-- ARGV[1] holder, ARGV[2] dispatch id, ARGV[3] its stop marker, ARGV[4] '1' when its message is redelivered,
-- ARGV[5] the queued lease and marker ttl in s, ARGV[6] the marker's value (when it went back to its queue)
-- returns {running marker removed, lease removed}
local freed = 0
if redis.call('GET', KEYS[1]) == ARGV[1] then
    redis.call('DEL', KEYS[1])
    freed = 1
end
local lease = redis.call('GET', KEYS[2])
local dropped = 0
if freed == 1 and lease == ARGV[2] and ARGV[4] == '1' then
    redis.call('EXPIRE', KEYS[2], ARGV[5])
    redis.call('SET', KEYS[4], ARGV[6], 'EX', ARGV[5])
elseif freed == 1 and (lease == ARGV[2] or lease == ARGV[3]) then
    redis.call('DEL', KEYS[2])
    dropped = 1
end
redis.call('DEL', KEYS[3])
return {freed, dropped}
