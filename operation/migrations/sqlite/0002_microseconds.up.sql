-- Times in microseconds: the Runner now writes created_at, updated_at and
-- finished_at as UTC ISO 8601 text with six decimals ("…05.123456Z"),
-- read from the process clock. Rows written with milliseconds ("…05.123Z",
-- which sorts after every six-decimal text of the same millisecond) are
-- rewritten to the same instant in six decimals, so that the open records
-- list in time order. The columns' DEFAULT (strftime, milliseconds) stays:
-- the Runner always sets them, and SQLite cannot change a default in place.
UPDATE {{.Table}} SET created_at = substr(created_at, 1, 23) || '000Z'
WHERE length(created_at) = 24 AND substr(created_at, 24, 1) = 'Z';

UPDATE {{.Table}} SET updated_at = substr(updated_at, 1, 23) || '000Z'
WHERE length(updated_at) = 24 AND substr(updated_at, 24, 1) = 'Z';

UPDATE {{.Table}} SET finished_at = substr(finished_at, 1, 23) || '000Z'
WHERE length(finished_at) = 24 AND substr(finished_at, 24, 1) = 'Z';
