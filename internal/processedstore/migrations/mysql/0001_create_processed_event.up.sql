-- The processed-event table (the inbox) for MySQL 8.0.13+ / MariaDB 10.11+:
-- event_id as BINARY(16) (compact, byte order of the UUID text, so UUIDv7
-- keys stay append-only in the clustered primary key); consumer as
-- VARBINARY so it compares exactly (the default collations ignore case and
-- trailing spaces); processed_at in UTC.
CREATE TABLE IF NOT EXISTS {{.Table}} (
    consumer     varbinary(255) NOT NULL,
    event_id     binary(16)   NOT NULL,
    processed_at datetime(6)  NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    PRIMARY KEY (consumer, event_id),
    KEY {{.Prefix}}_processed_at_idx (processed_at)
);
