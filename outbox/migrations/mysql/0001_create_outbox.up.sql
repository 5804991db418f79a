-- The outbox: one row per message written in a producer's transaction,
-- deleted by the relay in the transaction that publishes it.
CREATE TABLE IF NOT EXISTS {{.Table}} (
    id             bigint       NOT NULL AUTO_INCREMENT PRIMARY KEY,
    event_id       varchar(255) NOT NULL,
    topic          varchar(255) NOT NULL,
    payload        longblob     NOT NULL,
    metadata       mediumtext         NOT NULL,
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
    payload        longblob     NOT NULL,
    metadata       mediumtext         NOT NULL,
    created_at_us  bigint       NOT NULL,
    attempts       int          NOT NULL,
    reason         text         NOT NULL,
    dead_at_us     bigint       NOT NULL
);
CREATE TABLE IF NOT EXISTS {{.Archive}} (
    id             bigint       PRIMARY KEY,
    event_id       varchar(255) NOT NULL,
    topic          varchar(255) NOT NULL,
    payload        longblob     NOT NULL,
    metadata       mediumtext         NOT NULL,
    created_at_us  bigint       NOT NULL,
    relayed_at_us  bigint       NOT NULL,
    INDEX {{.Prefix}}_relayed_created (created_at_us),
    INDEX {{.Prefix}}_relayed_relayed (relayed_at_us)
);
CREATE TABLE IF NOT EXISTS {{.Lock}} (
    name           varchar(64)  PRIMARY KEY,
    beat_us        bigint       NOT NULL DEFAULT 0
);
INSERT INTO {{.Lock}} (name) VALUES ('relay') ON DUPLICATE KEY UPDATE name = name;
