-- Worker-lost starts per pair: a job that kills its worker (CUDA OOM, segfault, the OOM killer) never
-- ends, so it never clears its start. The next start of the pair (a redelivery of the same dispatch or a
-- new dispatch after reconcile) finds it open and counts one worker-lost start; at
-- ANIMASTOR_WORKER_LOST_LIMIT the pair fails (domain/job_rules.py). Any end of a started job clears it.

CREATE TABLE job_starts (
    book_id       text NOT NULL,
    chapter_id    text NOT NULL,
    scene_id      text NOT NULL,
    stage         text NOT NULL,
    open_dispatch text,                     -- the dispatch whose start has not ended yet; NULL when none
    lost_starts   integer NOT NULL DEFAULT 0, -- starts in a row that found the previous one never ended
    updated_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (book_id, chapter_id, scene_id, stage),
    FOREIGN KEY (book_id, chapter_id, scene_id, stage) REFERENCES asset_states ON DELETE CASCADE
);
