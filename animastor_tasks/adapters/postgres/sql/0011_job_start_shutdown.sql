-- When the worker running the open start was told to shut down (a warm shutdown: SIGTERM, as a rollout sends
-- before it kills): a start left open after that was ended by the operator, not by its scene, and the next start
-- does not count it as worker-lost. Without it, a scene chased from worker to worker by a rolling restart failed
-- `worker_lost` after ANIMASTOR_WORKER_LOST_LIMIT kills, as one that crashes every worker does.
ALTER TABLE job_starts ADD COLUMN shutdown_at timestamptz;
