-- A target released to `dirty` while its command was active (its layer turned off, its stage
-- BLOCKED, its dead lease found without authority) can no longer progress: it is marked with the
-- reason, so it no longer holds its command open and the command settles (completed or failed).
-- NULL: not released. Set once; the pair may be queued again later by another command.
ALTER TABLE command_targets ADD COLUMN released text;
