-- The books due by now, their entries pushed to the end of a lease rather than removed: the book's pass writes its
-- own next due time (or takes the entry away), and a pass lost on its way (a control worker killed holding its
-- batch: control tasks are acknowledged on receipt) is asked for again when the lease runs out.
-- KEYS[1] the due index
-- ARGV[1] now, ARGV[2] the lease's end
-- returns the books taken
local books = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
for first = 1, #books, 500 do
    local args = {}
    for n = first, math.min(first + 499, #books) do
        args[#args + 1] = ARGV[2]
        args[#args + 1] = books[n]
    end
    redis.call('ZADD', KEYS[1], unpack(args))
end
return books
