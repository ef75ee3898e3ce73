-- The input hash a started job read: a regenerate without force joins a running job only when the job is making
-- media from the scene's inputs as they are now. Without it, a scene re-imported with new text while its job ran
-- was joined by the next regenerate without force, whose command that job's commit then completed with media made
-- from the old text. NULL (a start recorded by an older version): unknown, and joined as before.
ALTER TABLE job_starts ADD COLUMN input_hash text;
