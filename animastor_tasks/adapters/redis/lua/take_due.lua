-- The books due by now taken off the due index, and those whose lease ran out (the tick sent their pass, and none
-- ran: a control worker killed holding its batch, control tasks being acknowledged on receipt), each leased until
-- ARGV[2] (its pass takes the lease away; one that runs out, the tick sends the book again).
-- KEYS[1] the due index, KEYS[2] the leases
-- ARGV[1] now, ARGV[2] the lease's end
-- returns the books taken, each once
local books = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
local seen = {}
for _, book in ipairs(books) do
    seen[book] = true
end
for _, book in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[1])) do
    if not seen[book] then
        seen[book] = true
        books[#books + 1] = book
    end
end
for first = 1, #books, 500 do
    local args = {}
    for n = first, math.min(first + 499, #books) do
        args[#args + 1] = ARGV[2]
        args[#args + 1] = books[n]
    end
    redis.call('ZADD', KEYS[2], unpack(args))
end
return books
