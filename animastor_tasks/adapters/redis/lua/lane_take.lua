-- Take the books at the head of a lane's waiting list, in one step, so two concurrent
-- hand-overs never take the same book; optionally queue the book whose job freed the slot
-- behind them, at its own priority (read from the finished dispatch's metadata).
-- KEYS[1] the lane's waiting list (zset: book -> wait score, lower first)
-- KEYS[2] the finished dispatch's metadata hash (field `rank`), or '' for no re-queue
-- ARGV[1] how many books to take
-- ARGV[2] a book never to take ('' for none): the one that freed the slot
-- ARGV[3] now (unix seconds), ARGV[4] the score of one priority rank, ARGV[5] the default rank
-- returns the books taken, best first
local count = tonumber(ARGV[1])
local taken = {}
if count > 0 then
    for _, book in ipairs(redis.call('ZRANGE', KEYS[1], 0, count)) do
        if book ~= ARGV[2] and #taken < count then
            taken[#taken + 1] = book
        end
    end
end
if #taken > 0 then
    redis.call('ZREM', KEYS[1], unpack(taken))
    if KEYS[2] ~= '' and ARGV[2] ~= '' then
        local rank = tonumber(redis.call('HGET', KEYS[2], 'rank') or ARGV[5]) or tonumber(ARGV[5])
        redis.call('ZADD', KEYS[1], 'NX', rank * tonumber(ARGV[4]) + tonumber(ARGV[3]), ARGV[2])
    end
end
return taken
