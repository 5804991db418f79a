-- Payload verification: the event's name and a fingerprint of what was
-- applied (see the PostgreSQL migration). NULL on rows written before this
-- migration (plain duplicates).
ALTER TABLE {{.Table}} ADD COLUMN event_name TEXT;

ALTER TABLE {{.Table}} ADD COLUMN fingerprint BLOB;
