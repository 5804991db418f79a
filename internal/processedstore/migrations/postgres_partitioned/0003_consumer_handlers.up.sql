-- The handlers each consumer name has served (see the plain layout's
-- 0005_consumer_handlers).
CREATE TABLE IF NOT EXISTS {{.Schema}}{{.Q}}{{.Prefix}}_handler{{.Q}} (
    consumer text   NOT NULL,
    handler  text   NOT NULL,
    seen_us  bigint NOT NULL,
    PRIMARY KEY (consumer, handler)
);
