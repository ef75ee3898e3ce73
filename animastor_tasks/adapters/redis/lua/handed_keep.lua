-- A handed book whose refill could not read it keeps its place at the head of the priority it was handed the
-- slot with (its hand-over record; without one, ARGV[2]), rather than pass the slot on.
-- KEYS[1] the lane's hand-over record (hash: book -> '<handed at> <wait score>'), KEYS[2] its waiting list
-- ARGV[1] the book, ARGV[2] its rank when no record says, ARGV[3] the score of one priority rank
local value = redis.call('HGET', KEYS[1], ARGV[1])
local score = value and tonumber(string.match(value, '^%S+ (%S+)$') or '')
local scale = tonumber(ARGV[3])
local rank = score and math.floor(score / scale) or tonumber(ARGV[2])
redis.call('ZADD', KEYS[2], 'LT', rank * scale, ARGV[1])
redis.call('HDEL', KEYS[1], ARGV[1])
