-- A gate batch's hold on its books' passes, written while it runs: the books whose pass ended let go, the others
-- held to a new end. Only entries this batch wrote are touched (their score is the end it wrote last): a newer
-- batch of the same book holds it now, and a lapsed hold the tick took is the tick's.
-- KEYS[1] the held passes (book -> when its hold lapses)
-- ARGV[1] the end this batch wrote last ('' before its first write), ARGV[2] the new end ('' when none is held on),
-- ARGV[3] how many books come first whose pass ended, then those books, then the books still held
-- returns how many of the books still held had lost this batch's hold (it lapsed and the tick took it)
local seen, ends, ended = ARGV[1], ARGV[2], tonumber(ARGV[3])
local lost = 0
for i = 4, #ARGV do
    local book = ARGV[i]
    local score = redis.call('ZSCORE', KEYS[1], book)
    if seen == '' or (score and tonumber(score) == tonumber(seen)) then
        if i < 4 + ended or ends == '' then
            redis.call('ZREM', KEYS[1], book)
        else
            redis.call('ZADD', KEYS[1], ends, book)
        end
    elseif not score and i >= 4 + ended and ends ~= '' then
        lost = lost + 1
    end
end
return lost
