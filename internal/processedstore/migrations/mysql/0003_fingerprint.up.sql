-- Payload verification: the event's name and a fingerprint of what was
-- applied (see the PostgreSQL migration). NULL on rows written before this
-- migration (plain duplicates). event_name as VARBINARY compares and stores
-- the bytes exactly, like consumer.
ALTER TABLE {{.Table}}
    ADD COLUMN event_name varbinary(1024) NULL,
    ADD COLUMN fingerprint varbinary(64) NULL;
