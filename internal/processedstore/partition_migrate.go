package processedstore

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// The upgrade from a plain table to LayoutPartitioned (README "Retention",
// "From a plain table to the partitioned layout").
//
// The switch is metadata only, one short transaction (but for the rows of
// <table>_v7, processed migration 8, copied into the legacy table): the plain table is
// renamed <table>_legacy (its rows stay where they are: no copy of a
// billion rows), the partitioned layout is created under the table's name,
// and a row trigger on it and on <table>_other moves a claimed event's row
// out of the legacy table into the table the claim inserts into, and then
// skips the claim's own row. A claim of an event processed before the
// switch therefore inserts nothing (a duplicate), and its verdict and the
// payload verification find the moved row; an expired one is refused by
// the claim's window before any row reaches the trigger. Consumers still
// configured with LayoutPlain keep working: their statements name the table,
// which is now the partitioned one (PostgreSQL resolves the name again after
// the rename), and its trigger consults the legacy table for them too.
//
// Ids that are not UUIDv7 claimed after the switch: LayoutPlain consumers
// insert them into the partitioned table, LayoutPartitioned ones into
// <table>_other; the trigger moves such a row from the one to the other on
// the next claim, under a transaction-scoped advisory lock of the (consumer,
// event) that both kinds take, so two such claims at once are serialised.
//
// Two claims of one legacy event at once: the first DELETEs the legacy row
// (row lock); the second's DELETE waits for it and, once the first commits,
// finds nothing, so it inserts and meets the first's moved row on the
// primary key (ON CONFLICT DO NOTHING: a duplicate). If the first rolls
// back, the legacy row is back and the second moves it.
//
// The Purger DELETE-purges the legacy table by event_at like the default
// partition. FinishPartitionMigration drops the legacy table and the
// triggers once no row is left in it.

// legacyMoveTrigger is the trigger's SQL: %[1]s the function's qualified
// name, %[2]s the quoted legacy table, %[3]s the quoted parent, %[4]s the
// quoted side table, %[5]s the trigger's name, %[6]s the side table's bare
// name as a literal, %[7]d the advisory lock space (legacyLockSpace), %[8]s
// the UUIDv7 time of r.event_id (a legacy row the lean claim wrote without
// event_at; the partitioned tables keep event_at NOT NULL).
const legacyMoveTrigger = `CREATE OR REPLACE FUNCTION %[1]s() RETURNS trigger LANGUAGE plpgsql AS $fn$
DECLARE
    r record;
BEGIN
    -- The row of this event claimed before the switch, moved here.
    DELETE FROM %[2]s WHERE consumer = NEW.consumer AND event_id = NEW.event_id RETURNING * INTO r;
    IF NOT FOUND AND get_byte(uuid_send(NEW.event_id), 6) >> 4 <> 7 THEN
        -- An id that is not a UUIDv7 claimed since the switch by the
        -- other kind of consumer: LayoutPlain ones insert it into the
        -- partitioned table, LayoutPartitioned ones into the side table.
        -- Both take this transaction-scoped lock of the (consumer, event)
        -- first and keep it to their commit, so the second waits for the
        -- first and then sees its row (READ COMMITTED: each statement here
        -- reads with a fresh snapshot).
        PERFORM pg_advisory_xact_lock(%[7]d, hashtext(NEW.consumer || ' ' || NEW.event_id::text));
        IF TG_TABLE_NAME = %[6]s THEN
            DELETE FROM %[3]s WHERE consumer = NEW.consumer AND event_id = NEW.event_id RETURNING * INTO r;
        ELSE
            DELETE FROM %[4]s WHERE consumer = NEW.consumer AND event_id = NEW.event_id RETURNING * INTO r;
        END IF;
    END IF;
    IF NOT FOUND THEN
        RETURN NEW;
    END IF;
    EXECUTE format('INSERT INTO %%I.%%I (consumer, event_id, processed_at, event_at, event_name, fingerprint) VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT DO NOTHING',
        TG_TABLE_SCHEMA, TG_TABLE_NAME)
        USING r.consumer, r.event_id, r.processed_at, coalesce(r.event_at, %[8]s), r.event_name, r.fingerprint;
    RETURN NULL; -- the claim inserts nothing: a duplicate
END
$fn$;
DROP TRIGGER IF EXISTS %[5]s ON %[3]s;
CREATE TRIGGER %[5]s BEFORE INSERT ON %[3]s FOR EACH ROW EXECUTE FUNCTION %[1]s();
DROP TRIGGER IF EXISTS %[5]s ON %[4]s;
CREATE TRIGGER %[5]s BEFORE INSERT ON %[4]s FOR EACH ROW EXECUTE FUNCTION %[1]s()`

// legacyLockSpace is the first key of the two-key advisory locks the
// trigger takes per (consumer, event) for ids that are not UUIDv7 (two-key
// locks never collide with the one-key locks of the purgers).
const legacyLockSpace = 0x1de1

// switchLockTimeout bounds the switch's wait for its ACCESS EXCLUSIVE lock
// on the plain table (claims in flight hold it for their transaction).
const switchLockTimeout = 5 * time.Second

// ErrLegacyNotEmpty is returned by FinishPartitionMigration while the
// legacy table still holds rows.
var ErrLegacyNotEmpty = errors.New("processed: the legacy table still holds rows")

// MigrateToPartitioned converts the store's table from the plain layout to
// LayoutPartitioned (the store must be configured with LayoutPartitioned;
// PostgreSQL 14+). It first brings the plain table to the plain layout's
// latest migration, then, in one transaction that waits at most 5 s for its
// lock (else it returns the lock_timeout error, SQLSTATE 55P03, and changes
// nothing: run it again), renames the table to <table>_legacy, creates the
// partitioned layout and the triggers that consult the legacy table (see
// the comment at the top of partition_migrate.go), and records the
// partitioned layout's migrations; last it creates the partitions of the
// current and next spans. Consumers configured either way may run during
// the switch. Running it again after it succeeded does nothing (nil).
//
// Store.Processed does not look in the legacy table (the claim does,
// through the trigger; LookupQuery after ReadLegacy). Call FinishPartitionMigration once the
// purger has emptied the legacy table and every consumer has run with
// LayoutPartitioned for one horizon (see its doc).
func (s *Store) MigrateToPartitioned(ctx context.Context, q sqldb.Querier) error {
	if s.layout != LayoutPartitioned {
		return ErrNotPartitioned
	}
	kind, err := s.relkind(ctx, q, s.table.Quoted('"'))
	if err != nil {
		return err
	}
	switch kind {
	case "p":
		return nil // already switched
	case "":
		return s.Migrate(ctx, q) // nothing to convert
	}
	plain, err := NewStore(Config{Table: s.table.String(), Horizon: s.horizon, MaxFutureSkew: s.skew})
	if err != nil {
		return err
	}
	if err := plain.Migrate(ctx, q); err != nil {
		return fmt.Errorf("processed: migrate to partitioned: bring the plain table up to date: %w", err)
	}
	ms, err := s.Migrations()
	if err != nil {
		return err
	}
	legacy := s.sibling("legacy")
	name := s.table.Name()
	qualifier := ""
	if sc, _, ok := strings.Cut(s.table.String(), "."); ok {
		qualifier = `"` + sc + `".`
	}
	script := []string{
		fmt.Sprintf("SET LOCAL lock_timeout = '%dms'", switchLockTimeout.Milliseconds()),
		// The rename takes the ACCESS EXCLUSIVE lock (no LOCK TABLE, which
		// YugabyteDB lacks): it waits for the claims in flight.
		fmt.Sprintf(`ALTER TABLE %s RENAME TO "%s_legacy"`, s.table.Quoted('"'), name),
		// The primary key's index keeps its name (<table>_pkey) through the
		// rename; the new table needs it.
		fmt.Sprintf(`DO $do$ DECLARE c name; BEGIN
    SELECT conname INTO c FROM pg_constraint WHERE conrelid = '%[1]s'::regclass AND contype = 'p';
    IF c IS NOT NULL AND c <> '%[2]s_legacy_pkey' THEN
        EXECUTE format('ALTER TABLE %[1]s RENAME CONSTRAINT %%I TO %%I', c, '%[2]s_legacy_pkey');
    END IF;
END $do$`, legacy, name),
	}
	// The UUIDv7 claim table (migration 0008) is folded into the legacy
	// table: renamed first, which waits for its claims in flight and
	// makes every later one fail (42P01) until its consumer falls back to
	// the table (Store.FoldedV7), then its rows copied and the tables
	// dropped. A cost of one row insertion per row claimed there.
	v7, err := plain.v7Exists(ctx, q)
	if err != nil {
		return err
	}
	if v7 {
		folded := qualifier + `"` + name + `_v7_folded"`
		script = append(script,
			fmt.Sprintf(`ALTER TABLE %s RENAME TO "%s_v7_folded"`, s.sibling("v7"), name),
			fmt.Sprintf(`DROP TRIGGER IF EXISTS "%s_v7_mirror" ON %s`, name, legacy),
			// processed_at: the event's time (<table>_v7 keeps none).
			fmt.Sprintf(`INSERT INTO %s (consumer, event_id, processed_at, fingerprint) SELECT c.name, v.event_id, %s, v.fingerprint FROM %s v JOIN %s c ON c.id = v.consumer ON CONFLICT DO NOTHING`,
				legacy, v7TimeSQL("v.event_id"), folded, s.sibling("consumer")),
			fmt.Sprintf(`DROP TABLE %s, %s, %s`, folded, s.sibling("v7_ready"), s.sibling("consumer")),
			fmt.Sprintf(`DROP FUNCTION IF EXISTS %s"%s_v7_mirror"()`, qualifier, name))
	}
	for _, m := range ms {
		script = append(script, strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(m.SQL), ";")))
	}
	// The first spans, created in the switch itself: once it commits,
	// claims reach the new table at once, and a row in the default
	// partition would keep its span from being created.
	var now time.Time
	if err := q.QueryRow(ctx, `SELECT now()`).Scan(&now); err != nil {
		return fmt.Errorf("processed: migrate to partitioned: clock: %w", err)
	}
	script = append(script, s.spanStatements(now.UTC())...)
	fn := fmt.Sprintf(`%s"%s_legacy_move"`, qualifier, name)
	script = append(script, fmt.Sprintf(legacyMoveTrigger, fn, legacy, s.table.Quoted('"'), s.sibling("other"), `"`+name+`_legacy_move"`, "'"+name+"_other'", legacyLockSpace, v7TimeSQL("r.event_id")))
	if _, err := q.Exec(ctx, strings.Join(script, ";\n")); err != nil {
		return fmt.Errorf("processed: migrate to partitioned: switch %s: %w", s.table, err)
	}
	// Records the partitioned layout's migrations (all IF NOT EXISTS: they
	// find what the switch created) and creates the first spans.
	return s.Migrate(ctx, q)
}

func (s *Store) relkind(ctx context.Context, q sqldb.Querier, quoted string) (string, error) {
	var kind string
	if err := q.QueryRow(ctx, `SELECT coalesce((SELECT relkind::text FROM pg_class WHERE oid = to_regclass($1)), '')`, quoted).Scan(&kind); err != nil {
		return "", fmt.Errorf("processed: read %s: %w", quoted, err)
	}
	return kind, nil
}

// legacyExists reports whether the table has a legacy table (an upgrade
// from the plain layout not finished).
func (s *Store) legacyExists(ctx context.Context, q sqldb.Querier) (bool, error) {
	kind, err := s.relkind(ctx, q, s.sibling("legacy"))
	return kind != "", err
}

// FinishPartitionMigration ends the upgrade MigrateToPartitioned began: when
// the legacy table is empty (the Purger deletes its rows once they are past
// the horizon; ErrLegacyNotEmpty otherwise) it drops the triggers, their
// function and the legacy table, in one transaction that waits at most 2 s
// for its locks. Without a legacy table it does nothing (nil).
//
// Call it only when every consumer has run with LayoutPartitioned for one
// horizon: a consumer still configured with LayoutPlain claims an event
// whose id is not a UUIDv7 into the partitioned table, where the
// partitioned layout's consumers do not look (they use <table>_other);
// while the triggers exist they move such a row on the next claim, after
// they are gone they would not.
func (s *Store) FinishPartitionMigration(ctx context.Context, q sqldb.Querier) error {
	if s.layout != LayoutPartitioned {
		return ErrNotPartitioned
	}
	ok, err := s.legacyExists(ctx, q)
	if err != nil || !ok {
		return err
	}
	var left bool
	if err := q.QueryRow(ctx, fmt.Sprintf(`SELECT EXISTS (SELECT 1 FROM %s)`, s.sibling("legacy"))).Scan(&left); err != nil {
		return fmt.Errorf("processed: finish the partition migration: %w", err)
	}
	if left {
		return fmt.Errorf("%w: %s", ErrLegacyNotEmpty, s.sibling("legacy"))
	}
	name := s.table.Name()
	qualifier := ""
	if sc, _, ok := strings.Cut(s.table.String(), "."); ok {
		qualifier = `"` + sc + `".`
	}
	trigger := `"` + name + `_legacy_move"`
	script := strings.Join([]string{
		fmt.Sprintf("SET LOCAL lock_timeout = '%dms'", dropLockTimeout.Milliseconds()),
		fmt.Sprintf("DROP TRIGGER IF EXISTS %s ON %s", trigger, s.table.Quoted('"')),
		fmt.Sprintf("DROP TRIGGER IF EXISTS %s ON %s", trigger, s.sibling("other")),
		fmt.Sprintf(`DROP FUNCTION IF EXISTS %s"%s_legacy_move"()`, qualifier, name),
		// Empty when checked, and nothing inserts into it any more; a row
		// deleted by a claim not yet committed would still be seen above.
		fmt.Sprintf("DROP TABLE %s", s.sibling("legacy")),
	}, ";\n")
	if _, err := q.Exec(ctx, script); err != nil {
		return fmt.Errorf("processed: finish the partition migration: %w", err)
	}
	return nil
}

// purgeLegacyBatch deletes at most limit rows of the legacy table dated
// before now() − horizon (PurgeBatch's statement on that table).
func (s *Store) purgeLegacyBatch(ctx context.Context, q sqldb.Querier, horizon time.Duration, limit int) (int64, error) {
	n, err := q.Exec(ctx, fmt.Sprintf(postgresSQL.purgeBatch, s.sibling("legacy")), s.sql.purgeArgs(horizon, limit)...)
	if err != nil {
		return 0, fmt.Errorf("processed: purge the legacy table: %w", err)
	}
	return n, nil
}
