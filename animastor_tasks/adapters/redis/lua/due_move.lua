-- A book's due entry moved to the time its full pass found, later or sooner, only while it is still the one that
-- pass read (a tick's lease); an entry moved since (a job that ended made the book due now) is someone's newer
-- word: it is only brought forward, if the pass's time is sooner (ZADD LT).
-- KEYS[1] the due index
-- ARGV[1] the book, ARGV[2] its due time as the pass read it, ARGV[3] the pass's due time
-- returns 1 when moved, 0 otherwise
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if score and tonumber(score) == tonumber(ARGV[2]) then
    redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
    return 1
end
redis.call('ZADD', KEYS[1], 'LT', ARGV[3], ARGV[1])
return 0
