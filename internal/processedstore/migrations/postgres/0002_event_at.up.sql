-- The event's own time (its UUIDv7 timestamp, else its occurred_at, else the
-- claim's time), set by the claim. Retention is keyed by it: the claim
-- refuses an event whose event_at is older than now() − horizon and the
-- purge deletes rows whose event_at is older than now() − horizon, with the
-- same database clock, the same value and the same horizon, so a redelivery
-- either finds its row or is refused, whatever the producer's and the
-- consumer's clocks say.
--
-- ADD COLUMN with a stable default is instant (PostgreSQL 11+): existing
-- rows read event_at = the time of this migration, which keeps them at least
-- one horizon from now on (never purged early). The default also serves
-- binaries of an older release during a rolling upgrade.
--
-- On a large table, build the index first without blocking writes:
--   CREATE INDEX CONCURRENTLY <table>_event_at_idx ON <table> (event_at);
-- (IF NOT EXISTS below then skips it.) The processed_at index, used by no
-- statement any more, is dropped: one index insertion less per claim.
ALTER TABLE {{.Table}} ADD COLUMN IF NOT EXISTS event_at timestamptz NOT NULL DEFAULT now();

CREATE INDEX IF NOT EXISTS {{.Prefix}}_event_at_idx ON {{.Table}} (event_at);

DROP INDEX IF EXISTS {{.IndexSchema}}{{.Prefix}}_processed_at_idx;
