-- Commands over for good (completed, failed, cancelled) by the time they ended: reconcile prunes those past
-- the retention (`ANIMASTOR_COMMAND_RETENTION_DAYS`) oldest first, a few at a time, without reading the rest.
-- The statuses are the domain's `ENDED` (domain/vocabulary.py).
CREATE INDEX commands_ended ON commands (updated_at) WHERE status IN ('cancelled', 'completed', 'failed');
