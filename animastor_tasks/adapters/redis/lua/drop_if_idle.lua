-- A book with no active scene off the active set and the due index, its deferrals gone, in one step. *Why:* read
-- and removed in three round trips, a scene activated in between (reconcile, a regenerate) left the book active
-- with its pending work off the due index, unvisited by the tick until reconcile's round came back to it. The
-- deferrals of a book with no queued work say nothing (its next regenerate clears those of its targets), and
-- reconcile, which prunes them, visits active books only: every finished book kept its sets for ever.
-- KEYS[1] the book's active scenes, KEYS[2] the active books, KEYS[3] the due index, KEYS[4..] its deferrals
-- ARGV[1] the book
-- returns 1 when dropped, 0 when it has active scenes
if redis.call('SCARD', KEYS[1]) > 0 then
    return 0
end
redis.call('SREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
for i = 4, #KEYS do
    redis.call('DEL', KEYS[i])
end
return 1
