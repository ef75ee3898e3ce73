-- A holder's renewal of its held passes: those whose pass ended let go, the others held to a new end, but only
-- while still held (a hold that lapsed was taken by the tick, which sent its pass again: it is not written back).
-- KEYS[1] the held passes (member -> when its hold lapses)
-- ARGV[1] the new end, ARGV[2] how many members come first whose pass ended, then those members, then the held ones
-- returns how many of the held ones had lapsed
local ends, ended = ARGV[1], tonumber(ARGV[2])
local lost = 0
for i = 3, #ARGV do
    if i < 3 + ended then
        redis.call('ZREM', KEYS[1], ARGV[i])
    elseif redis.call('ZSCORE', KEYS[1], ARGV[i]) then
        redis.call('ZADD', KEYS[1], ends, ARGV[i])
    else
        lost = lost + 1
    end
end
return lost
