-- A handed book whose refill could not read it keeps its place at the head of the priority it was handed the
-- slot with (its hand-over record), rather than pass the slot on. Without a record, a place on the list (one a
-- refill that failed before kept, the record gone with it) gives the priority; without either, the book gets no
-- place: its job's end left it nothing pending (lane_take.lua wrote no record). *Why:* at a default `normal`, the
-- second failure (the refill sent on to the control worker, Postgres still failing over) put a bulk book ahead of
-- every normal waiter, and a finished book drew the next free slot for nothing.
-- KEYS[1] the lane's hand-over record (hash: book -> '<handed at> <wait score>'), KEYS[2] its waiting list
-- ARGV[1] the book, ARGV[2] the score of one priority rank
local value = redis.call('HGET', KEYS[1], ARGV[1])
local score = nil  -- a missing field is `false` here, not nil: `value and ...` kept it, and `score / scale` raised
if value then
    score = tonumber(string.match(value, '^%S+ (%S+)$') or '')
end
if score == nil then
    score = tonumber(redis.call('ZSCORE', KEYS[2], ARGV[1]) or '')
end
if score ~= nil then
    local scale = tonumber(ARGV[2])
    redis.call('ZADD', KEYS[2], 'LT', math.floor(score / scale) * scale, ARGV[1])
end
redis.call('HDEL', KEYS[1], ARGV[1])
