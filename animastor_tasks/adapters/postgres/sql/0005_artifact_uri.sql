-- Where each artifact lies: file:///... for the local directory store, s3://bucket/key for the shared
-- store of many hosts (ANIMASTOR_ARTIFACT_URL). NULL for artifacts committed before this migration.
ALTER TABLE artifacts ADD COLUMN uri text;
