-- The event's own time (its UUIDv7 timestamp, else its occurred_at, else the
-- claim's time) as UTC ISO 8601 text with milliseconds, set by the claim;
-- retention is keyed by it (see the PostgreSQL migration). SQLite cannot add
-- a column with a non-constant default: existing rows take the time of this
-- migration (never purged early).
ALTER TABLE {{.Table}} ADD COLUMN event_at TEXT;

UPDATE {{.Table}} SET event_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now') WHERE event_at IS NULL;

CREATE INDEX IF NOT EXISTS {{.Prefix}}_event_at_idx ON {{.Table}} (event_at);

DROP INDEX IF EXISTS {{.Prefix}}_processed_at_idx;
