-- What the request behind a command asked for, beyond the commands it made: every stage it named (one whose layer
-- was off made no command) and whether it named scenes or the whole book. A resend of its command_id must ask the
-- same; with only the commands to go by, a resend that added a stage, or asked for the whole book where the first
-- sending named scenes, got the first sending's commands back and its own intent was dropped without a word.
-- NULL (a command written by an older version): unknown, and not held against a resend.
ALTER TABLE commands ADD COLUMN requested_stages text[], ADD COLUMN whole_book boolean;
