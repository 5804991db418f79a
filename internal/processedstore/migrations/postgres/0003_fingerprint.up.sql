-- Payload verification (middleware.Config.DisablePayloadVerification): the
-- claim stores the event's name and a fingerprint of what was applied (a
-- version byte, then SHA-256 of the event name and the payload bytes), so a
-- later message with the same event_id but other content is reported as a
-- conflict instead of being acked as a duplicate. Both columns are NULL on
-- rows written before this migration, or with verification off: such rows
-- are plain duplicates. ADD COLUMN of a nullable column without a default
-- rewrites nothing (instant on any PostgreSQL version).
ALTER TABLE {{.Table}}
    ADD COLUMN IF NOT EXISTS event_name text,
    ADD COLUMN IF NOT EXISTS fingerprint bytea;
