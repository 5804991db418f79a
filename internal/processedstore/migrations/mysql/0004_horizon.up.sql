-- The table's replay horizon, kept with the table so that every consumer
-- and every purger of it agrees on one value (one row, id 1). horizon_us is
-- the horizon in microseconds (0: none, nothing is refused or purged);
-- previous_us the value before the last change and changed_us when that
-- change was made (Unix microseconds): for a day after a shortening the
-- purge keeps the longer of the two, so consumers still running with the
-- old horizon never accept an event whose record was purged.
CREATE TABLE IF NOT EXISTS {{.IndexSchema}}`{{.Prefix}}_horizon` (
    id          int NOT NULL PRIMARY KEY,
    horizon_us  bigint NOT NULL,
    previous_us bigint NOT NULL,
    changed_us  bigint NOT NULL
);
