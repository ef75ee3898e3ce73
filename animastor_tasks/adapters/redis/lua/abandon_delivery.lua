-- The job a worker process held when it died, each step only while still that process's job's. Its running
-- marker goes, so a redelivery of its message runs it. Its lease stays as it is when that redelivery is coming
-- (never made longer: the process may have died after its job committed, with its lease not yet released);
-- else the lease (or the stop marker a fenced job holds) goes too, so the tick takes the pair over now rather
-- than once the lease lapses.
-- A lease dropped leaves a mark that the job's own process, dying but not dead yet (Celery's hard time limit lets
-- it go, then kills it a tenth of a second later), never takes the lease back (lua/retake_lease.lua): taken back,
-- it held the pair a whole lease TTL after the kill.
-- KEYS[1] the dispatch's running marker, KEYS[2] the pair's lease, KEYS[3] the holder's entry, KEYS[4] its mark
-- ARGV[1] holder, ARGV[2] dispatch id, ARGV[3] its stop marker, ARGV[4] '1' when its message is redelivered,
-- ARGV[5] the mark's ttl in s
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
    redis.call('SET', KEYS[4], '1', 'EX', ARGV[5])
    dropped = 1
end
redis.call('DEL', KEYS[3])
return {freed, dropped}
