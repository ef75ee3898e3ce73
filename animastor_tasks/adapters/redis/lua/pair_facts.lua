-- What a pass reads of each of its pairs, the pairs named once (sent four times, as one SMISMEMBER and a
-- ZMSCORE per bucket, their encoding was most of a big book's Redis read).
-- KEYS[1] the book's force set, KEYS[2..] its deferral buckets (sorted sets: pair -> deferral end)
-- ARGV[1] now (the Redis server's clock, as the ends), ARGV[2..] the pair members
-- Returns, per key, the 0-based places of the pairs found: in the force set, its places; in a bucket, the first
-- of the ends past now (nil: none), then the places of the pairs deferred past now.
local now = tonumber(ARGV[1])
local last = #ARGV
local STEP = 1000 -- members per call: `unpack` puts them all on Lua's stack, which holds a few thousand
local found = {}
local function ask(command, k, first, upto) -- an error names the key (a key of another type: WRONGTYPE)
    local reply = redis.pcall(command, KEYS[k], unpack(ARGV, first, upto))
    if type(reply) == 'table' and reply.err then
        return error({err = reply.err .. ' (' .. command .. ' ' .. KEYS[k] .. ')'})
    end
    return reply
end
for k = 1, #KEYS do
    local out = {}
    local first_end = nil
    if k > 1 then
        out[1] = false
    end
    for first = 2, last, STEP do
        local upto = math.min(first + STEP - 1, last)
        if k == 1 then
            local hits = ask('SMISMEMBER', 1, first, upto)
            for i = 1, #hits do
                if hits[i] == 1 then
                    out[#out + 1] = first + i - 3
                end
            end
        else
            local ends = ask('ZMSCORE', k, first, upto)
            for i = 1, upto - first + 1 do
                local ends_at = ends[i] and tonumber(ends[i])
                if ends_at and ends_at > now then
                    out[#out + 1] = first + i - 3
                    if first_end == nil or ends_at < first_end then
                        first_end = ends_at
                        out[1] = ends[i]
                    end
                end
            end
        end
    end
    found[k] = out
end
return found
