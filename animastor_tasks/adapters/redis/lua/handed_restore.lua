-- Books handed a slot whose refill never reported back (a control worker killed running it, a broker that
-- refused the message, a GPU process that died refilling): back on the waiting list at the place they had.
-- KEYS[2i-1] a lane's hand-over record (hash: book -> '<handed at> <wait score>'), KEYS[2i] its waiting list
-- ARGV[1] how long ago, at least, the hand-over was (seconds, by the Redis server's clock)
-- returns the books put back, each as '<i>' then the book (i: the lane's number in KEYS, from 1)
local time = redis.call('TIME')
local now = tonumber(time[1]) + tonumber(time[2]) / 1e6
local min_age = tonumber(ARGV[1])
local restored = {}
for i = 1, #KEYS, 2 do
    local record = redis.call('HGETALL', KEYS[i])
    for j = 1, #record, 2 do
        local book, value = record[j], record[j + 1]
        local at, score = string.match(value, '^(%S+) (%S+)$')
        if at == nil or now - tonumber(at) >= min_age then
            if score ~= nil then
                redis.call('ZADD', KEYS[i + 1], 'LT', score, book)
            end
            redis.call('HDEL', KEYS[i], book)
            restored[#restored + 1] = tostring((i + 1) / 2)
            restored[#restored + 1] = book
        end
    end
end
return restored
