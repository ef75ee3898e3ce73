-- The job a worker process held when it died, each step only while still that process's job's. Its running
-- marker goes, so a redelivery of its message runs it. Its lease stays as it is when that redelivery is coming
-- (never made longer: the process may have died after its job committed, with its lease not yet released);
-- else the lease (or the stop marker a fenced job holds) goes too, so the tick takes the pair over now rather
-- than once the lease lapses.
-- KEYS[1] the dispatch's running marker, KEYS[2] the pair's lease, KEYS[3] the holder's entry
-- ARGV[1] holder, ARGV[2] dispatch id, ARGV[3] its stop marker, ARGV[4] '1' when its message is redelivered
-- returns {running marker removed, lease removed}
local freed = 0
if redis.call('GET', KEYS[1]) == ARGV[1] then
    redis.call('DEL', KEYS[1])
    freed = 1
end
local lease = redis.call('GET', KEYS[2])
local dropped = 0
if freed == 1 and (lease == ARGV[3] or (lease == ARGV[2] and ARGV[4] ~= '1')) then
    redis.call('DEL', KEYS[2])
    dropped = 1
end
redis.call('DEL', KEYS[3])
return {freed, dropped}
