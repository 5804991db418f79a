-- Times in microseconds: claims now write event_at and processed_at as
-- UTC ISO 8601 text with six decimals ("…05.123456Z"), read from the
-- process clock. Rows written with milliseconds ("…05.123Z", which sorts
-- after every six-decimal text of the same millisecond) are rewritten to
-- the same instant in six decimals, so that old and new rows compare by
-- time. The columns' DEFAULT (strftime, milliseconds) stays: the claims
-- always set both columns, and SQLite cannot change a default in place.
UPDATE {{.Table}} SET event_at = substr(event_at, 1, 23) || '000Z'
WHERE length(event_at) = 24 AND substr(event_at, 24, 1) = 'Z';

UPDATE {{.Table}} SET processed_at = substr(processed_at, 1, 23) || '000Z'
WHERE length(processed_at) = 24 AND substr(processed_at, 24, 1) = 'Z';
