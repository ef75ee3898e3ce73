-- How many targets a command has, fixed when it is made (targets are never added later): whether a command
-- has few, whose targets are then looked up by key, is read from its row. Counted from command_targets,
-- statistics that estimated a command's targets at a handful made the count read all of a whole-book
-- command's. NULL (a command written by an older version) counts as many.
ALTER TABLE commands ADD COLUMN target_count integer;
UPDATE commands c SET target_count = (SELECT count(*) FROM command_targets t WHERE t.command_id = c.command_id);
