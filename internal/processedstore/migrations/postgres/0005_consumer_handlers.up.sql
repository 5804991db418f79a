-- The handlers each consumer name has served, and when last (Unix
-- microseconds): a consumer that starts with a handler name another process
-- used for the same consumer name within a day is reported at ERROR, since
-- two handlers that each receive their own copy of an event must not share
-- a claim key (the first one's claim makes the other's copy a duplicate).
CREATE TABLE IF NOT EXISTS {{.IndexSchema}}"{{.Prefix}}_handler" (
    consumer text NOT NULL,
    handler  text NOT NULL,
    seen_us  bigint NOT NULL,
    PRIMARY KEY (consumer, handler)
);
