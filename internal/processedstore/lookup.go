package processedstore

import (
	"context"
	"fmt"
	"time"

	"github.com/google/uuid"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// LookupQuery returns a read-only query of the rows of eventID, one row
// (consumer, processed_at) per consumer that processed it, oldest first; with
// consumer != "" only that consumer's row. It is for tools that need more
// than Processed's yes/no (the operators' command): run it with the
// driver's multi-row query (database/sql QueryContext, pgx Query).
// processed_at scans as a time.Time on PostgreSQL and MySQL (parseTime=true,
// UTC) and as ISO 8601 UTC text on SQLite. With LayoutPartitioned both
// queries read the side table <table>_other too; after ReadLegacy, the
// legacy table or <table>_v7. A row of <table>_v7 keeps no time of its
// own: its processed_at is the commit time of the claim that wrote it
// (pg_xact_commit_timestamp) when the server has track_commit_timestamp
// on and still knows that transaction, else NULL, as for a row Migrate
// copied there (committed before <table>_v7_ready's row). It is never the
// event's time, which would tell an operator that a late event was
// applied on time. NULL sorts last (PostgreSQL, the only dialect with
// such rows).
func (s *Store) LookupQuery(eventID uuid.UUID, consumer string) (string, []any) {
	q := s.rowsSource()
	p1, p2 := "?", "?"
	if s.dialect == sqldb.PostgreSQL {
		p1, p2 = "$1", "$2"
	}
	sql := fmt.Sprintf(`SELECT consumer, processed_at FROM %s WHERE event_id = %s`, q, p1)
	args := []any{s.sql.eventID(eventID)}
	if consumer != "" {
		sql += fmt.Sprintf(` AND consumer = %s`, p2)
		args = append(args, consumer)
	}
	return sql + ` ORDER BY processed_at, consumer`, args
}

// PurgePreviewQuery returns a read-only query of one row: the database
// clock now, the cutoff the purger uses with horizon (now minus horizon
// minus purgeClaimSlack, as the Purger cuts), the rows of the table, the rows older than
// the cutoff (those a purge run would delete now, locked rows aside; with
// LayoutPartitioned those of the default partition and the side and
// legacy tables: the time partitions are dropped whole, DropPreview), and
// the oldest event_at (NULL when the table is empty): the purge deletes by
// event time (event_at), on the database clock (SQLite: the process
// clock, as PurgeBatch reads it). Times scan as
// PurgeBatch's dialect stores them: time.Time on PostgreSQL and MySQL
// (UTC), ISO 8601 UTC text on SQLite.
func (s *Store) PurgePreviewQuery(horizon time.Duration) (string, []any) {
	horizon += purgeClaimSlack // as the Purger cuts (purgeClaimSlack)
	q := s.rowsSource()
	var now, cutoff string
	var args []any
	at := "event_at"
	switch s.dialect {
	case sqldb.MySQL:
		now, cutoff = `UTC_TIMESTAMP(6)`, `(UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND)`
		args = []any{horizon.Microseconds(), horizon.Microseconds()}
	case sqldb.SQLite:
		// The process clock, as the purge reads it (sql_sqlite.go).
		t := s.clock()
		now, cutoff = `?1`, `?2`
		args = []any{sqldb.SQLiteTime(t), sqldb.SQLiteTime(t.Add(-horizon.Truncate(time.Microsecond)))}
	default:
		now, cutoff = `now()`, `(now() - ($1::bigint * interval '1 microsecond'))`
		args = []any{horizon.Microseconds()}
		// A UUIDv7 row of the lean claim has no event_at: its id's time.
		at = "coalesce(event_at, " + v7TimeSQL("event_id") + ")"
	}
	deleted := "1 = 1"
	if s.layout == LayoutPartitioned {
		deleted = "r.deleted" // the time partitions are dropped whole (DropPreview)
	}
	return fmt.Sprintf(`SELECT %[2]s, %[3]s, count(*),
    COALESCE(SUM(CASE WHEN %[5]s AND %[4]s < %[3]s THEN 1 ELSE 0 END), 0),
    MIN(%[4]s)
FROM %[1]s`, q, now, cutoff, at, deleted), args
}

// rowsSource is what the read-only tool queries read the rows from: the
// table, and with LayoutPartitioned its side table <table>_other too, where
// the rows of ids other than UUIDv7 live, and <table>_legacy while an
// upgrade from the plain layout is not finished (ReadLegacy found it).
func (s *Store) rowsSource() string {
	q := s.table.Quoted(s.dialect.QuoteChar())
	if s.readV7 {
		// The rows of <table>_v7 that the table does not hold too (the
		// trigger's copies are in both). They keep no processed_at: the
		// commit time of their transaction stands for it where the server
		// records one (LookupQuery), NULL elsewhere; the CASE keeps
		// pg_xact_commit_timestamp from raising 55000 when it does not. A
		// row committed with or before <table>_v7_ready's row was written
		// by Migrate's copy, not by its claim: NULL too (a server that did
		// not record the ready row's commit had none for those either).
		ready := s.sibling("v7_ready")
		committed := "pg_xact_commit_timestamp(v.xmin)"
		at := "CASE WHEN current_setting('track_commit_timestamp') = 'on' THEN (SELECT CASE WHEN " + committed +
			" > coalesce(pg_xact_commit_timestamp(r.xmin), to_timestamp(r.ready_us / 1000000.0)) THEN " + committed +
			" END FROM " + ready + " r WHERE r.id = 1) END"
		return "(SELECT consumer, event_id, processed_at, event_at FROM " + q +
			" UNION ALL SELECT c.name, v.event_id, " + at + ", NULL::timestamptz FROM " +
			s.sibling("v7") + " v JOIN " + s.sibling("consumer") +
			" c ON c.id = v.consumer WHERE NOT EXISTS (SELECT 1 FROM " + q + " x WHERE x.consumer = c.name AND x.event_id = v.event_id)) AS r"
	}
	if s.layout != LayoutPartitioned {
		return q
	}
	// deleted: the row is one the Purger DELETEs when it expires (the
	// default partition, the side table, the legacy table), not one of a
	// time partition, which it drops whole.
	src := "(SELECT consumer, event_id, processed_at, event_at, tableoid = '" + s.sibling("default") + "'::regclass AS deleted FROM " + q +
		" UNION ALL SELECT consumer, event_id, processed_at, event_at, true FROM " + s.sibling("other")
	if s.readLegacy {
		src += " UNION ALL SELECT consumer, event_id, processed_at, event_at, true FROM " + s.sibling("legacy")
	}
	return src + ") AS r"
}

// ReadLegacy makes LookupQuery and PurgePreviewQuery read the legacy table
// too when it exists (LayoutPartitioned, MigrateToPartitioned not
// finished): its rows are the events processed before the upgrade, which
// the claim still finds (a redelivery is a duplicate) and the Purger
// deletes. The store must not be in use by other goroutines.
//
// On the plain PostgreSQL layout it makes them read <table>_v7 too when it
// exists (migration 0008), where the UUIDv7 claims are.
func (s *Store) ReadLegacy(ctx context.Context, q sqldb.Querier) error {
	if s.layout != LayoutPartitioned {
		ok, err := s.v7Exists(ctx, q)
		s.readV7 = ok
		return err
	}
	ok, err := s.legacyExists(ctx, q)
	s.readLegacy = ok
	return err
}
