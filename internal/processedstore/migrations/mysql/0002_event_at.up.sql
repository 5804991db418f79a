-- The event's own time (its UUIDv7 timestamp, else its occurred_at, else the
-- claim's time), in UTC, set by the claim; retention is keyed by it (see the
-- PostgreSQL migration). Existing rows read the time of this migration
-- (never purged early). One ALTER: the column, its index, and the drop of
-- the processed_at index that no statement uses any more.
ALTER TABLE {{.Table}}
    ADD COLUMN event_at datetime(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    ADD KEY {{.Prefix}}_event_at_idx (event_at),
    DROP KEY {{.Prefix}}_processed_at_idx;
