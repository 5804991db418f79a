-- The processed-event table (the inbox) for SQLite 3.35+: event_id as a
-- 16-byte BLOB, processed_at as UTC ISO 8601 text with milliseconds (which
-- sorts like the instant it names).
CREATE TABLE IF NOT EXISTS {{.Table}} (
    consumer     TEXT NOT NULL,
    event_id     BLOB NOT NULL,
    processed_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    PRIMARY KEY (consumer, event_id)
) WITHOUT ROWID;

CREATE INDEX IF NOT EXISTS {{.Prefix}}_processed_at_idx ON {{.Table}} (processed_at);
