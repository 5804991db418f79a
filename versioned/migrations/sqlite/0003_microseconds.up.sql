-- Times in microseconds: the family store now writes updated_at as UTC ISO
-- 8601 text with six decimals ("…05.123456Z"), read from the process
-- clock. Rows written with milliseconds ("…05.123Z", which sorts after
-- every six-decimal text of the same millisecond) are rewritten to the
-- same instant in six decimals, so that the purge compares old and new
-- rows by time. The columns' DEFAULT (strftime, milliseconds) stays: the
-- writes always set updated_at, and SQLite cannot change a default in place.
UPDATE {{.Latest}} SET updated_at = substr(updated_at, 1, 23) || '000Z'
WHERE length(updated_at) = 24 AND substr(updated_at, 24, 1) = 'Z';

UPDATE {{.Applied}} SET updated_at = substr(updated_at, 1, 23) || '000Z'
WHERE length(updated_at) = 24 AND substr(updated_at, 24, 1) = 'Z';

UPDATE {{.Retired}} SET updated_at = substr(updated_at, 1, 23) || '000Z'
WHERE length(updated_at) = 24 AND substr(updated_at, 24, 1) = 'Z';
