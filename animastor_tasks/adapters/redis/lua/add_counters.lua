-- Add one flushed batch of counter updates to the metrics hash, at most once however often it is sent:
-- a flush whose reply was lost (a timeout after Redis applied it) sends the same batch again, under the
-- same id, and the marker its first application set makes the resend change nothing. Applying and
-- marking happen in this one script, so neither is ever seen without the other.
-- KEYS[1] the metrics hash
-- KEYS[2] the batch's marker
-- ARGV[1] how long the marker lasts (seconds)
-- ARGV[2] how many (field, increment) pairs follow; after them, (field, value) pairs to set
-- returns 1 when the batch was applied now, 0 when it had been applied already
if not redis.call('SET', KEYS[2], '1', 'NX', 'EX', ARGV[1]) then
    return 0
end
local i = 3
for _ = 1, tonumber(ARGV[2]) do
    redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1])
    i = i + 2
end
for j = i, #ARGV, 2 do
    redis.call('HSET', KEYS[1], ARGV[j], ARGV[j + 1])
end
return 1
