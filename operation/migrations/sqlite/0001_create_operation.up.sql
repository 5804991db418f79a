-- The operations table for SQLite 3.35+ (columns as in the PostgreSQL
-- migration): owner is the token's 16 bytes, times are UTC ISO 8601 text
-- with milliseconds. "key" is quoted (a keyword).
CREATE TABLE IF NOT EXISTS {{.Table}} (
    "key"       TEXT    NOT NULL PRIMARY KEY,
    kind        TEXT    NOT NULL,
    fingerprint TEXT    NOT NULL,
    state       TEXT    NOT NULL
        CHECK (state IN ('started', 'succeeded', 'failed', 'uncertain')),
    reference   TEXT,
    result      BLOB,
    error       TEXT,
    attempts    INTEGER NOT NULL DEFAULT 0,
    owner       BLOB,
    created_at  TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    updated_at  TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    finished_at TEXT
) WITHOUT ROWID;

-- Open operations (to list what needs reconciliation), oldest first.
CREATE INDEX IF NOT EXISTS {{.IndexSchema}}{{.Prefix}}_open_idx ON {{.Bare}} (updated_at)
    WHERE state IN ('started', 'uncertain');
