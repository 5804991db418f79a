-- The table's replay horizon (see the plain layout's 0004_horizon).
CREATE TABLE IF NOT EXISTS {{.Schema}}{{.Q}}{{.Prefix}}_horizon{{.Q}} (
    id          int    NOT NULL PRIMARY KEY,
    horizon_us  bigint NOT NULL,
    previous_us bigint NOT NULL,
    changed_us  bigint NOT NULL
);
