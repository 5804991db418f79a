-- The outbox: one row per message written in a producer's transaction,
-- deleted by the relay in the transaction that publishes it.
CREATE TABLE IF NOT EXISTS {{.Table}} (
    id             INTEGER      PRIMARY KEY AUTOINCREMENT,
    event_id       varchar(255) NOT NULL,
    topic          varchar(255) NOT NULL,
    payload        blob        NOT NULL,
    metadata       text         NOT NULL,
    created_at_us  bigint       NOT NULL,
    attempts       int          NOT NULL DEFAULT 0,
    next_try_us    bigint       NOT NULL DEFAULT 0,
    first_fail_us  bigint       NOT NULL DEFAULT 0,
    last_error     text
);
CREATE TABLE IF NOT EXISTS {{.Dead}} (
    id             bigint       PRIMARY KEY,
    event_id       varchar(255) NOT NULL,
    topic          varchar(255) NOT NULL,
    payload        blob        NOT NULL,
    metadata       text         NOT NULL,
    created_at_us  bigint       NOT NULL,
    attempts       int          NOT NULL,
    reason         text         NOT NULL,
    dead_at_us     bigint       NOT NULL
);
CREATE TABLE IF NOT EXISTS {{.Archive}} (
    id             bigint       PRIMARY KEY,
    event_id       varchar(255) NOT NULL,
    topic          varchar(255) NOT NULL,
    payload        blob        NOT NULL,
    metadata       text         NOT NULL,
    created_at_us  bigint       NOT NULL,
    relayed_at_us  bigint       NOT NULL
);
CREATE INDEX IF NOT EXISTS {{.Prefix}}_relayed_created ON {{.Archive}} (created_at_us);
CREATE INDEX IF NOT EXISTS {{.Prefix}}_relayed_relayed ON {{.Archive}} (relayed_at_us);
CREATE TABLE IF NOT EXISTS {{.Lock}} (
    name           varchar(64)  PRIMARY KEY,
    beat_us        bigint       NOT NULL DEFAULT 0
);
INSERT INTO {{.Lock}} (name) VALUES ('relay') ON CONFLICT DO NOTHING;
