-- The input hash a started job read, and the dispatch whose start read it: a regenerate without force joins a
-- running job only when that job is making media from the scene's inputs as they are now. Without it, a scene
-- re-imported with new text while its job ran was joined by the next regenerate without force, whose command that
-- job's commit then completed with media made from the old text. A start recorded by an older version leaves both
-- as they were: its dispatch is not the one named, and it is joined as before.
ALTER TABLE job_starts ADD COLUMN input_hash text, ADD COLUMN input_dispatch text;
