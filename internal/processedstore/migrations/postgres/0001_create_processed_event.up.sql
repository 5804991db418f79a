-- The processed-event table (the inbox): one row per (consumer, event_id)
-- whose effect was committed. The primary key serialises concurrent claims of
-- one event; processed_at drives purge by replay horizon.
CREATE TABLE IF NOT EXISTS {{.Table}} (
    consumer     text        NOT NULL,
    event_id     uuid        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
);

CREATE INDEX IF NOT EXISTS {{.Prefix}}_processed_at_idx ON {{.Table}} (processed_at);
