-- The lean claim (issue 25): a UUIDv7 row is written without event_at, its
-- time being its id (RFC 9562 §5.7, Unix milliseconds in the first 48
-- bits); the purge finds such rows by a range of the primary key, and the
-- event_at index keeps only rows that have an event_at (ids of other
-- versions, and rows written before this migration or by an older
-- release), so a UUIDv7 claim updates the primary key alone.
--
-- Online: DROP NOT NULL and DROP DEFAULT change the catalog only (no scan,
-- no rewrite); an older release's claim, which always writes event_at
-- (releases since migration 0002), keeps working against the table, on the same primary
-- key: a claim by either release is a duplicate for the other, during the
-- deploy and after it, and rows written before this migration stay
-- duplicates. An older release's purge deletes only rows with an event_at
-- (it keeps the new UUIDv7 rows longer, never shorter).
--
-- On a large table, build the partial index first without blocking writes:
--   CREATE INDEX CONCURRENTLY <table>_event_at_set_idx ON <table> (event_at)
--     WHERE event_at IS NOT NULL;
-- (IF NOT EXISTS below then skips it.)
--
-- A table its owner partitioned (relkind 'p': by hash or range on
-- event_id, or a plain table converted to LayoutPartitioned) is left as
-- it is: event_at stays NOT NULL DEFAULT now(), so the lean claim's
-- UUIDv7 rows are dated by the claim's now() there (kept at least as long).
-- +goose StatementBegin
DO $lean$
BEGIN
    IF (SELECT relkind FROM pg_class WHERE oid = to_regclass('{{.Table}}')) = 'r' THEN
        ALTER TABLE {{.Table}} ALTER COLUMN event_at DROP NOT NULL, ALTER COLUMN event_at DROP DEFAULT;
        CREATE INDEX IF NOT EXISTS {{.Prefix}}_event_at_set_idx ON {{.Table}} (event_at) WHERE event_at IS NOT NULL;
        DROP INDEX IF EXISTS {{.IndexSchema}}{{.Prefix}}_event_at_idx;
    END IF;
END
$lean$;
-- +goose StatementEnd
