-- The operations table for MySQL 8.0.16+ / MariaDB 10.11+ (columns as in
-- the PostgreSQL migration). `key` is a reserved word: always quoted. It is
-- VARBINARY, so keys compare byte by byte (no case folding, no trailing-space
-- padding); owner is the token's 16 bytes; times are UTC. MySQL has no
-- partial index: the open-operations index covers every row, by state.
-- Index and CHECK names are left to MySQL (per table), so long table names
-- stay within its 64 characters.
CREATE TABLE IF NOT EXISTS {{.Table}} (
    `key`       varbinary(255) NOT NULL,
    kind        varchar(64)    NOT NULL,
    fingerprint varchar(64)    NOT NULL,
    state       varchar(16)    NOT NULL,
    reference   text,
    result      longblob,
    error       mediumtext,
    attempts    int            NOT NULL DEFAULT 0,
    owner       binary(16),
    created_at  datetime(6)    NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    updated_at  datetime(6)    NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    finished_at datetime(6),
    PRIMARY KEY (`key`),
    KEY open_idx (state, updated_at),
    CHECK (state IN ('started', 'succeeded', 'failed', 'uncertain'))
);
