-- Which lanes have had free slots and books waiting for them since an earlier tick: a slot whose refill was
-- lost (the process that freed it died after its commit, a control worker was killed running the refill).
-- KEYS[1] hash: queue -> when (Redis server time) its lane was first seen with free slots and books waiting
-- KEYS[2..n] the waiting lists of the lanes named in ARGV[2..] (the lanes with free slots now)
-- ARGV[1] how long ago, at least, the earlier sighting was (seconds): a refill on its way takes milliseconds
-- returns the lanes seen so at least that long ago; their sightings are taken away, and so are the sightings of
-- lanes now full or with nobody waiting
local time = redis.call('TIME')
local now = tonumber(time[1]) + tonumber(time[2]) / 1e6
local min_age = tonumber(ARGV[1])
local stranded, seen = {}, {}
for i = 2, #KEYS do
    local queue = ARGV[i]
    if redis.call('ZCARD', KEYS[i]) > 0 then
        local since = tonumber(redis.call('HGET', KEYS[1], queue) or '')
        if since == nil then
            redis.call('HSET', KEYS[1], queue, tostring(now))
            seen[queue] = true
        elseif now - since >= min_age then
            stranded[#stranded + 1] = queue
        else
            seen[queue] = true
        end
    end
end
for _, queue in ipairs(redis.call('HKEYS', KEYS[1])) do
    if not seen[queue] then
        redis.call('HDEL', KEYS[1], queue)
    end
end
return stranded
