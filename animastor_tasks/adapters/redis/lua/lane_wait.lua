-- A book refused a slot of the lane waits for one (`DeferralStore.wait_for_lane`): a book already waiting keeps
-- its place or moves up to a better one, but the place it was given as it was served a slot of the lane
-- (`domain.deferral.served_since`) stands against a refusal at the same priority for as long as the job it was
-- served may run; its job's end moves it (lua/lane_take.lua), as a takeover of that job does.
-- *Why:* moved to the refusal's time, a book whose job outlived its waiting pairs' capacity deferral (60 s) went
-- before every book that came to wait after that, though its job still ran: round robin fell back to first come.
-- KEYS[1] the lane's waiting list (zset: book -> wait score, lower first)
-- ARGV[1] the book, ARGV[2] its wait score now (its rank times ARGV[3], plus the time it waits from)
-- ARGV[3] the score of one priority rank, ARGV[4] where a served place begins within a rank (SERVED_AFTER)
-- ARGV[5] how long a served job may run (seconds): a served place older than that moves like any other
-- returns 1 when the book's place was written
local score = tonumber(ARGV[2])
local current = tonumber(redis.call('ZSCORE', KEYS[1], ARGV[1]) or '')
if current ~= nil then
    if score >= current then
        return 0
    end
    local scale, served_after = tonumber(ARGV[3]), tonumber(ARGV[4])
    local since, held = score % scale, current % scale
    local same_rank = math.floor(current / scale) == math.floor(score / scale)
    if same_rank and held >= served_after and since > 0 and since < held - served_after + tonumber(ARGV[5]) then
        return 0
    end
end
redis.call('ZADD', KEYS[1], score, ARGV[1])
return 1
