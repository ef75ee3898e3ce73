-- The reads of a book's snapshot (state.py `_read_snapshots`), made only while its active index holds at
-- most ARGV[1] scenes: a big book's sets are not shipped to a caller that would not pass it whole.
-- KEYS[1] the force set, KEYS[2] the active scenes, KEYS[3..] the deferral zsets
-- ARGV[1] the most active scenes, ARGV[2] now (unix seconds)
-- returns false for a bigger book; else the force set, the active scenes, then per deferral zset its live
-- members and the first of them with its score
if redis.call('SCARD', KEYS[2]) > tonumber(ARGV[1]) then
    return false
end
local after = '(' .. ARGV[2]
local found = {redis.call('SMEMBERS', KEYS[1]), redis.call('SMEMBERS', KEYS[2])}
for i = 3, #KEYS do
    found[#found + 1] = redis.call('ZRANGEBYSCORE', KEYS[i], after, '+inf')
    found[#found + 1] = redis.call('ZRANGEBYSCORE', KEYS[i], after, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
end
return found
