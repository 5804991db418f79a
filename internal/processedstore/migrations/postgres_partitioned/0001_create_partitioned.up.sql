-- The partitioned layout of the processed-event table (Config.Layout =
-- LayoutPartitioned, PostgreSQL 14+): partitions by event time, so that
-- retention drops whole partitions (O(1) per partition) instead of deleting
-- rows.
--
-- {{.Table}} holds UUIDv7 events only, RANGE-partitioned on event_id: a
-- UUIDv7 starts with its 48-bit Unix millisecond timestamp (RFC 9562 §5.7)
-- and uuid compares bytewise, so the ids of one time span form one range,
-- and the primary key (consumer, event_id), which contains the partition
-- key, stays global. The Purger creates the spans' partitions ahead
-- ({{.Prefix}}_pYYYYMMDDHHMM, Config.PartitionSpan each) and drops those
-- whose whole span is older than the purge horizon. A UUIDv7 for which no
-- partition exists yet lands in {{.Prefix}}_default, purged by DELETE.
--
-- Other ids carry no time in the id, so a range of ids is no range of time:
-- they go to {{.Prefix}}_other, a plain table purged by DELETE on event_at.
CREATE TABLE IF NOT EXISTS {{.Table}} (
    consumer     text        NOT NULL,
    event_id     uuid        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    event_at     timestamptz NOT NULL DEFAULT now(),
    event_name   text,
    fingerprint  bytea,
    PRIMARY KEY (consumer, event_id)
) PARTITION BY RANGE (event_id);

CREATE TABLE IF NOT EXISTS {{.Schema}}{{.Q}}{{.Prefix}}_default{{.Q}} PARTITION OF {{.Table}} DEFAULT;

CREATE INDEX IF NOT EXISTS {{.Prefix}}_default_event_at_idx ON {{.Schema}}{{.Q}}{{.Prefix}}_default{{.Q}} (event_at);

CREATE TABLE IF NOT EXISTS {{.Schema}}{{.Q}}{{.Prefix}}_other{{.Q}} (
    consumer     text        NOT NULL,
    event_id     uuid        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    event_at     timestamptz NOT NULL DEFAULT now(),
    event_name   text,
    fingerprint  bytea,
    PRIMARY KEY (consumer, event_id)
);

CREATE INDEX IF NOT EXISTS {{.Prefix}}_other_event_at_idx ON {{.Schema}}{{.Q}}{{.Prefix}}_other{{.Q}} (event_at);
