-- {{.Retired}}: each consumer's newest poisoned message of each family (see
-- the PostgreSQL migration).
CREATE TABLE IF NOT EXISTS {{.Retired}} (
    consumer    TEXT NOT NULL,
    family_kind TEXT NOT NULL,
    family_id   TEXT NOT NULL,
    order_key   BLOB NOT NULL,
    event_id    BLOB NOT NULL,
    updated_at  TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    PRIMARY KEY (consumer, family_kind, family_id)
) WITHOUT ROWID;
