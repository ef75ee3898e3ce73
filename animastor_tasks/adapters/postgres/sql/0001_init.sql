-- Books, their reading order, commands, asset states with fencing tokens,
-- artifacts, cancel tombstones and the event journal.

CREATE TABLE books (
    book_id       text PRIMARY KEY,
    title         text NOT NULL,
    layer_config  text,                    -- raw JSON; missing/broken means every stage enabled
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE chapters (
    book_id     text NOT NULL REFERENCES books ON DELETE CASCADE,
    chapter_id  text NOT NULL,
    position    integer NOT NULL,
    title       text NOT NULL DEFAULT '',
    PRIMARY KEY (book_id, chapter_id)
);

CREATE TABLE scenes (
    book_id       text NOT NULL,
    chapter_id    text NOT NULL,
    scene_id      text NOT NULL,
    position      integer NOT NULL,        -- reading order across the whole book
    text          text NOT NULL,
    prompt        text NOT NULL DEFAULT '',
    input_hashes  jsonb NOT NULL DEFAULT '{}'::jsonb,  -- {stage: hash of the stage's current input}
    PRIMARY KEY (book_id, chapter_id, scene_id),
    FOREIGN KEY (book_id, chapter_id) REFERENCES chapters ON DELETE CASCADE
);
CREATE INDEX scenes_reading_order ON scenes (book_id, position);

CREATE TABLE asset_states (
    book_id         text NOT NULL,
    chapter_id      text NOT NULL,
    scene_id        text NOT NULL,
    stage           text NOT NULL,
    state           text NOT NULL DEFAULT 'dirty'
                    CHECK (state IN ('dirty', 'pending', 'generating', 'ready', 'failed')),
    fencing_token   bigint NOT NULL DEFAULT 0,
    dispatch_id     text,
    input_hash      text,                  -- hash of the inputs the ready artifact was made from
    artifact_sha256 text,
    error           text,
    updated_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (book_id, chapter_id, scene_id, stage),
    FOREIGN KEY (book_id, chapter_id, scene_id) REFERENCES scenes ON DELETE CASCADE
);
-- Only in-flight pairs are indexed: a tick never pays for idle (dirty/ready) pairs.
CREATE INDEX asset_states_in_flight ON asset_states (book_id, stage, state)
    WHERE state IN ('pending', 'generating');

CREATE TABLE commands (
    command_id  uuid PRIMARY KEY,
    book_id     text NOT NULL REFERENCES books ON DELETE CASCADE,
    stage       text NOT NULL,
    status      text NOT NULL CHECK (status IN ('active', 'blocked', 'completed', 'cancelled', 'failed')),
    reason      text,
    force       boolean NOT NULL DEFAULT true,
    request_id  uuid NOT NULL,             -- the caller's command_id: resending it is a no-op
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    UNIQUE (request_id, stage)
);
CREATE INDEX commands_active ON commands (book_id) WHERE status = 'active';
CREATE INDEX commands_recent ON commands (book_id, created_at DESC);

CREATE TABLE command_targets (
    command_id  uuid NOT NULL REFERENCES commands ON DELETE CASCADE,
    book_id     text NOT NULL,
    chapter_id  text NOT NULL,
    scene_id    text NOT NULL,
    stage       text NOT NULL,
    PRIMARY KEY (command_id, chapter_id, scene_id)
);
CREATE INDEX command_targets_pair ON command_targets (book_id, chapter_id, scene_id, stage);

CREATE TABLE artifacts (
    id             bigserial PRIMARY KEY,
    sha256         text NOT NULL,
    size_bytes     bigint NOT NULL,
    media_type     text NOT NULL,
    book_id        text NOT NULL,
    chapter_id     text NOT NULL,
    scene_id       text NOT NULL,
    stage          text NOT NULL,
    fencing_token  bigint NOT NULL,
    dispatch_id    text NOT NULL,
    generator      text NOT NULL,
    duration_ms    integer NOT NULL,
    path           text NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT now(),
    UNIQUE (dispatch_id)                   -- a dispatch commits at most once
);
CREATE INDEX artifacts_pair ON artifacts (book_id, chapter_id, scene_id, stage);

CREATE TABLE cancel_tombstones (
    book_id       text PRIMARY KEY REFERENCES books ON DELETE CASCADE,
    reason        text,
    cancelled_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE events (
    id           bigserial PRIMARY KEY,
    at           timestamptz NOT NULL DEFAULT now(),
    kind         text NOT NULL,
    book_id      text,
    chapter_id   text,
    scene_id     text,
    stage        text,
    dispatch_id  text,
    detail       jsonb NOT NULL DEFAULT '{}'::jsonb
);
CREATE INDEX events_at ON events (at);
