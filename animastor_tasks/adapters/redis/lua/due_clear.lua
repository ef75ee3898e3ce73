-- A book off the due index, only while its entry is still the one the caller's pass read: an entry moved since
-- (a job that ended made the book due now) is someone's newer word, and the book keeps it.
-- KEYS[1] the due index
-- ARGV[1] the book, ARGV[2] its due time as the pass read it
-- returns 1 when taken off, 0 when the entry moved or is gone
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if score and tonumber(score) == tonumber(ARGV[2]) then
    return redis.call('ZREM', KEYS[1], ARGV[1])
end
return 0
