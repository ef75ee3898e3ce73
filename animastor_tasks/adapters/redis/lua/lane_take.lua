-- Take the books at the head of a lane's waiting list, in one step, so two concurrent
-- hand-overs never take the same book; optionally queue the book whose job freed the slot
-- behind them, at its own priority: the more urgent of the one it waits at already when it is
-- on the list (its pairs the lane refused) and that of its most urgent pair still pending (its
-- job's commit, failure or give-back read it: a reader's scene its book's cap refused waits on no
-- list). A book whose job's end left nothing pending of the lane neither keeps the slot nor waits
-- again, and a place it holds on the list goes (a stale one: a takeover's, whose pair a pass then
-- claimed): kept, it won the slot, or it bound the share of the book served, whose refill handed
-- the slot back; either way a refill found nothing and passed the slot on through the control
-- queue, the slot idle meanwhile (a place a pass wrote since that read goes too: its scene waits
-- out its capacity deferral).
-- That book keeps the slot instead when that priority is more urgent than the head's: the
-- answer is then that book alone, taken off the list as any book served is.
-- A book handed a slot within the hold (ARGV[6]) whose refill has not reported back (off the list, in the
-- hand-over record) still waits, at the score it was handed the slot with, for what the list leaves, and goes
-- before less urgent books: one more urgent than the book whose job freed the slot takes the slot that book would
-- keep; the handed books more urgent than the list's head are taken before it (a job's end or a book handing
-- slots on alike); and of slots a book hands on (ARGV[2] with no re-queue: its pass's unused ones, a refill's it
-- has no use for, its Stop All's), the most urgent handed books take those nobody listed waits for; not the books
-- handed a slot together with the book handing on (their records' time is its: that hand-over's last refill hands
-- on what is still free). A job's end that left its book nothing pending and found nobody listed leaves the slot
-- to that book's own refill (it moves the book's scene window, then hands the slot on), and a hand-over by no book
-- (a count of the lanes, which subtracts the slots handed books hold) takes listed books alone. Taken, a handed
-- book is handed one more slot: its record is written as of now, which a refill begun before leaves to the refill
-- sent now. *Why:* off the list, it was invisible to a slot freed moments later: a reader's second interactive
-- scene waited a whole bulk job while the book whose job freed that slot kept it for a bulk scene, or, another
-- bulk book listed behind the reader, while that book took it; and a slot a pass handed on for want of use went
-- to nobody beside a book with more pairs than its one handed slot, idle until the tick's stranded check.
-- KEYS[1] the lane's waiting list (zset: book -> wait score, lower first)
-- KEYS[2] the finished dispatch's metadata hash, or '' for no re-queue; deleted here (kept, it lived a queued
--         lease's four days after its job had ended: 1.3 GB at 1M jobs a day)
-- KEYS[3] a key to delete when no book is taken, or '' for none: the deferrals of the book that freed
--         the slot that wait for capacity, which may try again when nobody else waits
-- KEYS[4] the lane's breaker hash, or '' for none: while it is open (as breaker_acquire.lua says: before
--         `open_until`, or its half-open permit out) nobody is taken, and half-open one book at most (the one
--         its test permit is for): each other would find the lane refused and pass the slot on, emptying the
--         list and losing its order. A book re-queued meanwhile only joins the list (keeping its place there).
-- KEYS[5] the lane's hand-over record (hash: book -> '<now> <wait score>'): every book served is noted there
--         until its refill reports back, so that a refill lost puts its book back on the list (handed_restore.lua)
-- KEYS[6] the cancel flag of the book that freed the slot, or '' for none: set, the book is stopped (a Stop All
--         since its job's end read what it had left, whose Redis step took it off every list), and it neither keeps
--         the slot nor waits again, as with nothing left pending. *Why:* put back, a normal book drew a later slot
--         whose refill found nothing, and an interactive one kept the freed slot for nothing, which went on to the
--         waiter through the control queue. A regenerate lifts the flag before its commands are written.
-- ARGV[1] how many books to take, at most: the head's and those after it at the head's priority alone (the slots
--         of a hand-over go to the most urgent books waiting; one with no use for its share hands it on). *Why:*
--         one each from the head, a bulk book's refill run first took a slot a reader's second scene waited for.
-- ARGV[2] a book never to take ('' for none): the one that freed the slot
-- ARGV[3] now (unix seconds), ARGV[4] the score of one priority rank
-- ARGV[5] what the end (commit, failure or give-back) of the job that freed the slot left its book of the lane:
--         the rank of its most urgent pending pair, 'none' for nothing pending ('' with no re-queue)
-- ARGV[6] the hold (seconds): a record older than that is of a refill likely lost, which holds nothing
-- returns the books taken, best first
local count = tonumber(ARGV[1])
local refused = false
if KEYS[4] ~= '' then
    local now = tonumber(ARGV[3])
    local open_until = tonumber(redis.call('HGET', KEYS[4], 'open_until') or '0')
    if open_until > now or (open_until ~= 0 and tonumber(redis.call('HGET', KEYS[4], 'permit_until') or '0') > now) then
        count = 0
        refused = true
    elseif open_until ~= 0 then
        count = math.min(count, 1)
    end
end
local scale = tonumber(ARGV[4])
local own = nil
if ARGV[2] ~= '' and (ARGV[5] == 'none' or (KEYS[6] ~= '' and redis.call('EXISTS', KEYS[6]) == 1)) then
    redis.call('ZREM', KEYS[1], ARGV[2])
elseif KEYS[2] ~= '' and ARGV[2] ~= '' then
    -- Waiting already, the book's place says what it waits for: a reader's interactive scene refused
    -- behind its own bulk jobs, or bulk work left after an interactive job.
    own = tonumber(redis.call('ZSCORE', KEYS[1], ARGV[2]) or '')
    -- Its most urgent pending pair may wait on no list (a reader's scene its book's cap refused): the more urgent
    -- of the two counts.
    local pending = tonumber(ARGV[5]) * scale + tonumber(ARGV[3])
    if own == nil or pending < own then
        own = pending
    end
end
if KEYS[2] ~= '' then
    redis.call('DEL', KEYS[2])
end
local taken = {}
if count > 0 then
    local mine = own ~= nil and math.floor(own / scale) or nil
    -- A book handing slots on (its pass's unused ones, a refill's it had no use for, its Stop All's) gives the
    -- handed books the slots nobody listed waits for; a job's end, the slot its book would keep.
    local handing_on = KEYS[2] == '' and ARGV[2] ~= ''
    -- The books handed a slot within the hold that are off the list, most urgent first: {book, score, its text}.
    -- None for a hand-over by no book.
    local handed = {}
    if ARGV[2] ~= '' then
        local now, hold = tonumber(ARGV[3]), tonumber(ARGV[6])
        -- Not those handed a slot by the same hand-over as the book handing on (their records' time is its): that
        -- hand-over's last refill hands on what is still free (refill._close_hand_over).
        local fellows = handing_on and string.match(redis.call('HGET', KEYS[5], ARGV[2]) or '', '^(%S+) ') or nil
        local record = redis.call('HGETALL', KEYS[5])
        for j = 1, #record, 2 do
            local book = record[j]
            local at, text = string.match(record[j + 1], '^(%S+) (%S+)$')
            local score = tonumber(text or '')
            if book ~= ARGV[2] and score ~= nil and at ~= fellows and now - (tonumber(at) or 0) <= hold
                and not redis.call('ZSCORE', KEYS[1], book) then
                handed[#handed + 1] = {book, score, text}
            end
        end
        table.sort(handed, function(a, b)
            local ta, tb = math.floor(a[2] / scale), math.floor(b[2] / scale)
            if ta ~= tb then
                return ta < tb
            elseif a[2] ~= b[2] then
                return a[2] < b[2]
            end
            return a[1] < b[1]
        end)
    end
    local function take(book, text)
        taken[#taken + 1] = book
        redis.call('HSET', KEYS[5], book, ARGV[3] .. ' ' .. text)
    end
    -- Handed books up to `limit`, the least urgent rank taken (nil: the most urgent one's rank alone).
    local function take_handed(limit)
        for _, h in ipairs(handed) do
            local rank = math.floor(h[2] / scale)
            if #taken == count or (limit ~= nil and rank > limit) then
                break
            end
            limit = limit or rank
            take(h[1], h[3])
        end
    end
    local function outranks_mine()
        return #handed > 0 and math.floor(handed[1][2] / scale) < mine
    end
    local tier = nil
    local head = redis.call('ZRANGE', KEYS[1], 0, count, 'WITHSCORES')
    for i = 1, #head, 2 do
        local book, rank = head[i], math.floor(tonumber(head[i + 1]) / scale)
        if tier ~= nil and rank > tier then
            break
        end
        if book ~= ARGV[2] and #taken < count then
            if #taken == 0 and mine ~= nil and mine < rank then
                if outranks_mine() then
                    take_handed(nil)
                    break
                end
                redis.call('ZREM', KEYS[1], ARGV[2])
                redis.call('HSET', KEYS[5], ARGV[2], ARGV[3] .. ' ' .. own)
                return {ARGV[2]}
            end
            if tier == nil then
                take_handed(rank - 1) -- handed books more urgent than the head go first
            end
            tier = rank
            if #taken < count then
                take(book, head[i + 1])
            end
        end
    end
    if tier == nil and #taken == 0 and ((mine ~= nil and outranks_mine()) or (mine == nil and handing_on)) then
        take_handed(nil) -- nobody listed
    end
end
if #taken > 0 or refused then
    if #taken > 0 then
        redis.call('ZREM', KEYS[1], unpack(taken))
    end
    if own ~= nil then
        redis.call('ZADD', KEYS[1], 'LT', own, ARGV[2])
    end
else
    if KEYS[3] ~= '' then
        redis.call('DEL', KEYS[3])
    end
    if own ~= nil then
        -- Nobody else waits: the book is served, and off the list as any book served is; its next refusal puts
        -- it back at what it then waits for. Kept, its place stayed what an interactive scene once made it (a
        -- place only ever moves up), and its bulk scenes later went before a normal waiter.
        redis.call('ZREM', KEYS[1], ARGV[2])
        redis.call('HSET', KEYS[5], ARGV[2], ARGV[3] .. ' ' .. own)
    end
end
return taken
