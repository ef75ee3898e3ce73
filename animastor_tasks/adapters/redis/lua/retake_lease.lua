-- A running job whose lease vanished (Redis lost its data, or answered again after the lease lapsed) takes it
-- back with its delivery's markers, only while nobody holds the lease; the caller then reads in Postgres, under
-- the pair's row lock, that the pair is still this job's (its state, token and dispatch id), and gives the lease
-- up if not (flow/job.py `Watcher._take_back`).
-- Never a job its worker let go of as its process died (lua/abandon_delivery.lua).
-- KEYS[1] lease key, KEYS[2] running marker, KEYS[3] the holder's entry, KEYS[4] the holders of its worker node,
-- KEYS[5] the mark of a job let go of
-- ARGV[1] dispatch id, ARGV[2] lease ttl in ms, ARGV[3] holder (worker and process), ARGV[4] running marker
-- ttl in s, ARGV[5] the holder entry's ttl in s
-- returns 1 when taken back, 0 when another dispatch holds the lease or the job was let go of
if redis.call('EXISTS', KEYS[5]) == 1 or not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
    return 0
end
redis.call('SET', KEYS[2], ARGV[3], 'NX', 'EX', ARGV[4])
redis.call('SET', KEYS[3], ARGV[1] .. '\n' .. KEYS[1], 'EX', ARGV[5])
redis.call('SADD', KEYS[4], ARGV[3])
redis.call('EXPIRE', KEYS[4], ARGV[5])
return 1
