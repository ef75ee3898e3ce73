-- A handed book's refill has done its work: its hand-over record goes, unless the book was handed a slot again
-- after the refill began (that hand-over's refill has yet to report back).
-- KEYS[1] the lane's hand-over record (hash: book -> '<handed at> <wait score>')
-- ARGV[1] the book, ARGV[2] when the refill began (by the Redis server's clock, as the record's time)
local value = redis.call('HGET', KEYS[1], ARGV[1])
if value then
    local at = tonumber(string.match(value, '^(%S+) ') or '')
    if at == nil or at <= tonumber(ARGV[2]) then
        redis.call('HDEL', KEYS[1], ARGV[1])
        return 1
    end
end
return 0
