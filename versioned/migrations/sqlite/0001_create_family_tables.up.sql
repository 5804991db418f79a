-- The latest-per-family tables (versioned.FamilyStore) for SQLite 3.35+.
-- TEXT compares with the BINARY collation (byte by byte); order_key is
-- versioned.Position.MarshalBinary as a BLOB, compared bytewise; event_id is
-- the UUID's 16 bytes; times are UTC ISO 8601 text with milliseconds (which
-- sorts like the instant it names).
--
-- {{.Latest}}: the latest message published in each family, advanced by
-- versioned.LatestPublisher in the producer's transaction.
CREATE TABLE IF NOT EXISTS {{.Latest}} (
    family_kind TEXT    NOT NULL,
    family_id   TEXT    NOT NULL,
    order_key   BLOB    NOT NULL,
    event_id    BLOB    NOT NULL,
    seq         INTEGER,
    occurred_at TEXT,
    updated_at  TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    PRIMARY KEY (family_kind, family_id)
) WITHOUT ROWID;

CREATE INDEX IF NOT EXISTS {{.LatestSchema}}{{.LatestName}}_updated_at_idx ON {{.LatestBare}} (updated_at);

-- {{.Applied}}: the last message of each family that each consumer let
-- through to its handler, written in the handler's transaction by
-- versioned.LatestFilter.
CREATE TABLE IF NOT EXISTS {{.Applied}} (
    consumer    TEXT NOT NULL,
    family_kind TEXT NOT NULL,
    family_id   TEXT NOT NULL,
    order_key   BLOB NOT NULL,
    event_id    BLOB NOT NULL,
    updated_at  TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    PRIMARY KEY (consumer, family_kind, family_id)
) WITHOUT ROWID;

CREATE INDEX IF NOT EXISTS {{.AppliedSchema}}{{.AppliedName}}_updated_at_idx ON {{.AppliedBare}} (updated_at);
