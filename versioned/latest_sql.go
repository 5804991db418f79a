package versioned

import (
	"context"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/watermill-idempotency/idempotency/internal/purgeloop"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// This file holds all the SQL text of the family store, one statement set
// per dialect. %[1]s is the quoted latest table, %[2]s the quoted applied
// table. Every dialect's statements have the contract written on the
// PostgreSQL ones; how their result reads is in familySQL.

// familySQL is the family store's statement set for one pair of tables and
// the dialect's ways of binding and reading.
type familySQL struct {
	// advance and applied move a record forward when the incoming
	// order_key is greater. returning: they return one row when they wrote
	// (PostgreSQL, SQLite); otherwise their rows affected are 0 when
	// nothing moved (MySQL's ON DUPLICATE KEY UPDATE: 1 inserted, 2
	// updated).
	advance, applied string
	returning        bool
	advanceArgs      func(kind, id string, key []byte, eventID any, seq *int64, at *time.Time) []any
	appliedArgs      func(consumer, kind, id string, key []byte, eventID any) []any

	latest string
	// check is the filter's verdict in one statement (PostgreSQL); "" for
	// the dialects without data-modifying CTEs, where newer (is a newer
	// latest record there?) then applied run one after the other in the
	// handler's transaction.
	check, newer string
	// retire records a consumer's poisoned position of a family in the
	// retired table (parameters and arguments as applied; no result);
	// retired says whether a given position is the retired one (parameters
	// consumer, kind, id, order_key). See latest_retire.go.
	retire, retired string

	purgeLatest, purgeApplied, purgeRetired string
	purgeArgs                               func(horizon time.Duration, limit int64) []any

	eventID func(uuid.UUID) any
	// lock is the purger's lock for one run, held by conn's session, or by
	// the process (SQLite); name is the latest table (PostgreSQL) or both
	// tables (FamilyPurger.lockName).
	lock func(ctx context.Context, conn sqldb.Conn, name string) (unlock func(), ok bool, err error)
}

func familySQLFor(d sqldb.Dialect, latest, applied, retired sqldb.Ident) (familySQL, error) {
	l, a, r := latest.Quoted(d.QuoteChar()), applied.Quoted(d.QuoteChar()), retired.Quoted(d.QuoteChar())
	f := func(s string) string { return fmt.Sprintf(s, l, a, r) }
	var s familySQL
	switch d {
	case sqldb.PostgreSQL:
		s = familySQL{
			advance: f(pgFamilyAdvance), applied: f(pgFamilyApplied), returning: true,
			latest: f(pgFamilyLatest), check: f(pgFamilyCheck),
			retire: f(pgFamilyRetire), retired: f(pgFamilyRetired),
			purgeLatest:  fmt.Sprintf(pgFamilyPurge, l, "family_kind, family_id"),
			purgeApplied: fmt.Sprintf(pgFamilyPurge, a, "consumer, family_kind, family_id"),
			purgeRetired: fmt.Sprintf(pgFamilyPurge, r, "consumer, family_kind, family_id"),
			eventID:      func(id uuid.UUID) any { return pgtype.UUID{Bytes: id, Valid: true} },
			lock:         pgFamilyLock,
		}
	case sqldb.MySQL:
		s = familySQL{
			advance: f(myFamilyAdvance), applied: f(myFamilyApplied),
			advanceArgs: func(kind, id string, key []byte, eventID any, seq *int64, at *time.Time) []any {
				return []any{kind, id, key, eventID, seq, at, key, eventID, key, seq, key, at, key, key, key}
			},
			appliedArgs: func(consumer, kind, id string, key []byte, eventID any) []any {
				return []any{consumer, kind, id, key, eventID, key, eventID, key, key, key}
			},
			latest: f(myFamilyLatest), newer: f(myFamilyNewer),
			retire: f(myFamilyRetire), retired: f(myFamilyRetired),
			purgeLatest: fmt.Sprintf(myFamilyPurge, l), purgeApplied: fmt.Sprintf(myFamilyPurge, a),
			purgeRetired: fmt.Sprintf(myFamilyPurge, r),
			eventID:      func(id uuid.UUID) any { return id[:] },
			lock:         myFamilyLock,
		}
	case sqldb.SQLite:
		s = familySQL{
			advance: f(liteFamilyAdvance), applied: f(liteFamilyApplied), returning: true,
			advanceArgs: func(kind, id string, key []byte, eventID any, seq *int64, at *time.Time) []any {
				var text any // occurred_at as UTC RFC 3339 text, like updated_at
				if at != nil {
					text = at.UTC().Format(time.RFC3339Nano)
				}
				return []any{kind, id, key, eventID, seq, text, sqldb.SQLiteNow()}
			},
			appliedArgs: func(consumer, kind, id string, key []byte, eventID any) []any {
				return []any{consumer, kind, id, key, eventID, sqldb.SQLiteNow()}
			},
			latest: f(liteFamilyLatest), newer: f(liteFamilyNewer),
			retire: f(liteFamilyRetire), retired: f(liteFamilyRetired),
			purgeLatest:  fmt.Sprintf(liteFamilyPurge, l, "family_kind, family_id"),
			purgeApplied: fmt.Sprintf(liteFamilyPurge, a, "consumer, family_kind, family_id"),
			purgeRetired: fmt.Sprintf(liteFamilyPurge, r, "consumer, family_kind, family_id"),
			purgeArgs: func(h time.Duration, limit int64) []any {
				return []any{sqldb.SQLiteTime(time.Now().Add(-h.Truncate(time.Microsecond))), limit}
			},
			eventID: func(id uuid.UUID) any { return id[:] },
			lock:    liteFamilyLock,
		}
	default:
		return familySQL{}, fmt.Errorf("unsupported dialect %s", d)
	}
	if s.advanceArgs == nil {
		s.advanceArgs = func(kind, id string, key []byte, eventID any, seq *int64, at *time.Time) []any {
			return []any{kind, id, key, eventID, seq, at}
		}
	}
	if s.appliedArgs == nil {
		s.appliedArgs = func(consumer, kind, id string, key []byte, eventID any) []any {
			return []any{consumer, kind, id, key, eventID}
		}
	}
	if s.purgeArgs == nil {
		s.purgeArgs = func(h time.Duration, limit int64) []any { return []any{h.Microseconds(), limit} }
	}
	return s, nil
}

// PostgreSQL.
const (
	// pgFamilyAdvance moves a family's latest record forward: parameters
	// kind, id, order_key, event_id, seq (NULL when none), occurred_at (NULL
	// for numbered positions). ON CONFLICT DO UPDATE locks the existing row
	// (waiting for a concurrent producer's transaction) and evaluates the
	// WHERE clause on the latest committed row, so at READ COMMITTED the
	// newest position wins whatever the commit order. One row (true) when
	// the record moved, none when the stored position is equal or newer.
	pgFamilyAdvance = `INSERT INTO %[1]s AS cur (family_kind, family_id, order_key, event_id, seq, occurred_at)
VALUES ($1, $2, $3, $4, $5, $6)
ON CONFLICT (family_kind, family_id) DO UPDATE
SET order_key = EXCLUDED.order_key, event_id = EXCLUDED.event_id, seq = EXCLUDED.seq,
    occurred_at = EXCLUDED.occurred_at, updated_at = now()
WHERE cur.order_key < EXCLUDED.order_key
RETURNING true`

	// pgFamilyLatest reads a family's latest record: parameters kind, id.
	pgFamilyLatest = `SELECT order_key FROM %[1]s WHERE family_kind = $1 AND family_id = $2`

	// pgFamilyApplied records that a consumer lets a message through:
	// parameters consumer, kind, id, order_key, event_id. One row when the
	// position is newer than the consumer's last one (recorded), none when
	// equal or older (stale). The row lock is held until the handler's
	// transaction ends, so one consumer's handlers of one family run one at
	// a time.
	pgFamilyApplied = `INSERT INTO %[2]s AS cur (consumer, family_kind, family_id, order_key, event_id)
VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (consumer, family_kind, family_id) DO UPDATE
SET order_key = EXCLUDED.order_key, event_id = EXCLUDED.event_id, updated_at = now()
WHERE cur.order_key < EXCLUDED.order_key
RETURNING true`

	// pgFamilyCheck is the filter's verdict in one round trip when the
	// latest table is read in the handler's transaction: parameters as
	// pgFamilyApplied. It returns (obsolete, recorded): obsolete when the
	// latest record is newer than the message (then nothing is written);
	// otherwise the applied upsert runs and recorded says whether it wrote
	// (false: stale). A data-modifying CTE runs exactly once whether or not
	// the outer query reads it; the casts give the parameters their types,
	// which INSERT … SELECT would not infer.
	//
	// A latest record naming a message this consumer retired (poisoned:
	// %[3]s, see latest_retire.go) makes nothing obsolete: that message
	// will never be applied here.
	pgFamilyCheck = `WITH latest AS (
    SELECT EXISTS (SELECT 1 FROM %[1]s l
                   WHERE l.family_kind = $2::text AND l.family_id = $3::text AND l.order_key > $4::bytea
                     AND NOT EXISTS (SELECT 1 FROM %[3]s r
                                     WHERE r.consumer = $1::text AND r.family_kind = l.family_kind
                                       AND r.family_id = l.family_id AND r.order_key = l.order_key)) AS obsolete
), recorded AS (
    INSERT INTO %[2]s AS cur (consumer, family_kind, family_id, order_key, event_id)
    SELECT $1::text, $2::text, $3::text, $4::bytea, $5::uuid FROM latest WHERE NOT latest.obsolete
    ON CONFLICT (consumer, family_kind, family_id) DO UPDATE
    SET order_key = EXCLUDED.order_key, event_id = EXCLUDED.event_id, updated_at = now()
    WHERE cur.order_key < EXCLUDED.order_key
    RETURNING true
)
SELECT latest.obsolete, EXISTS (SELECT 1 FROM recorded) FROM latest`

	// pgFamilyRetire moves a consumer's retired position of a family
	// forward (parameters as pgFamilyApplied), committed on its own.
	pgFamilyRetire = `INSERT INTO %[3]s AS cur (consumer, family_kind, family_id, order_key, event_id)
VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (consumer, family_kind, family_id) DO UPDATE
SET order_key = EXCLUDED.order_key, event_id = EXCLUDED.event_id, updated_at = now()
WHERE cur.order_key < EXCLUDED.order_key`

	// pgFamilyRetired: is order_key the consumer's retired position of the
	// family? Parameters: consumer, kind, id, order_key.
	pgFamilyRetired = `SELECT EXISTS (SELECT 1 FROM %[3]s
    WHERE consumer = $1 AND family_kind = $2 AND family_id = $3 AND order_key = $4)`

	// pgFamilyPurge deletes at most $2 rows idle for longer than $1
	// microseconds by the database clock (now() is the transaction's start
	// on the server: neither the process's nor the session's time zone
	// enters the cutoff). Rows locked by a writer are skipped, not waited on.
	// %[2]s is the primary key's columns: rows are keyed by it, never by
	// ctid, which repeats across the partitions of a partitioned table.
	pgFamilyPurge = `DELETE FROM %[1]s WHERE (%[2]s) IN (
    SELECT %[2]s FROM %[1]s
    WHERE updated_at < now() - ($1::bigint * interval '1 microsecond')
    LIMIT $2
    FOR UPDATE SKIP LOCKED)`
)

// pgFamilyLockKey is the family purger's PostgreSQL lock key ($1: the
// latest table's quoted name; see pgFamilyLock).
const pgFamilyLockKey = `(x'1de1'::bigint << 32) | $1::regclass::oid::bigint`

// pgFamilyLock is the purger's session-level advisory lock, held for one
// whole run, so one purger works at a time per pair of tables. Its key is
// the latest table's OID (resolved through the search_path, so tables of
// one name in different schemas have different locks) under a constant high
// word that keeps it apart from other advisory-lock users (processed's
// purger uses 0x1de0). name is the latest table.
func pgFamilyLock(ctx context.Context, conn sqldb.Conn, name string) (func(), bool, error) {
	const key = pgFamilyLockKey
	var ok bool
	if err := conn.QueryRow(ctx, `SELECT pg_try_advisory_lock(`+key+`)`, name).Scan(&ok); err != nil || !ok {
		return nil, false, err
	}
	return func() {
		uctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_ = conn.QueryRow(uctx, `SELECT pg_advisory_unlock(`+key+`)`, name).Scan(&ok)
	}, true, nil
}

// MySQL 8.0+ and MariaDB 10.11+: the same text for both. The tables' text
// columns are VARBINARY, compared byte by byte like PostgreSQL's text
// under the C collation and bytea: no case folding, no trailing-space
// padding. order_key comparisons are memcmp order, as for bytea.
const (
	// myFamilyAdvance: as pgFamilyAdvance, with ON DUPLICATE KEY UPDATE
	// and IF() per column (order_key assigned last: MySQL evaluates the
	// assignments left to right). Rows affected: 1 inserted, 2 moved, 0 not
	// moved (needs clientFoundRows off). InnoDB locks the existing row and
	// compares with its latest committed version at any isolation level.
	// Parameters: kind, id, order_key, event_id, seq, occurred_at, then for
	// the update branch order_key, event_id, order_key, seq, order_key,
	// occurred_at, order_key, order_key, order_key (familySQL.advanceArgs).
	myFamilyAdvance = "INSERT INTO %[1]s (family_kind, family_id, order_key, event_id, seq, occurred_at)" +
		" VALUES (?, ?, ?, ?, ?, ?)" +
		" ON DUPLICATE KEY UPDATE" +
		" event_id = IF(order_key < ?, ?, event_id)," +
		" seq = IF(order_key < ?, ?, seq)," +
		" occurred_at = IF(order_key < ?, ?, occurred_at)," +
		" updated_at = IF(order_key < ?, UTC_TIMESTAMP(6), updated_at)," +
		" order_key = IF(order_key < ?, ?, order_key)"

	myFamilyLatest = "SELECT order_key FROM %[1]s WHERE family_kind = ? AND family_id = ?"

	// myFamilyApplied: as pgFamilyApplied, the row lock held until the
	// handler's transaction ends. Parameters: consumer, kind, id,
	// order_key, event_id, then order_key, event_id, order_key, order_key,
	// order_key.
	myFamilyApplied = "INSERT INTO %[2]s (consumer, family_kind, family_id, order_key, event_id)" +
		" VALUES (?, ?, ?, ?, ?)" +
		" ON DUPLICATE KEY UPDATE" +
		" event_id = IF(order_key < ?, ?, event_id)," +
		" updated_at = IF(order_key < ?, UTC_TIMESTAMP(6), updated_at)," +
		" order_key = IF(order_key < ?, ?, order_key)"

	// myFamilyNewer: is the latest record newer than order_key? A plain
	// (consistent, non-locking) read, so it never blocks producers; run
	// before myFamilyApplied in the handler's transaction. Parameters:
	// kind, id, order_key.
	// A latest record naming a message the consumer retired (%[3]s) does
	// not count. Parameters: kind, id, order_key, consumer.
	myFamilyNewer = "SELECT EXISTS (SELECT 1 FROM %[1]s l WHERE l.family_kind = ? AND l.family_id = ? AND l.order_key > ?" +
		" AND NOT EXISTS (SELECT 1 FROM %[3]s r WHERE r.consumer = ? AND r.family_kind = l.family_kind" +
		" AND r.family_id = l.family_id AND r.order_key = l.order_key))"

	// myFamilyRetire: as myFamilyApplied, on the retired table.
	myFamilyRetire = "INSERT INTO %[3]s (consumer, family_kind, family_id, order_key, event_id)" +
		" VALUES (?, ?, ?, ?, ?)" +
		" ON DUPLICATE KEY UPDATE" +
		" event_id = IF(order_key < ?, ?, event_id)," +
		" updated_at = IF(order_key < ?, UTC_TIMESTAMP(6), updated_at)," +
		" order_key = IF(order_key < ?, ?, order_key)"

	myFamilyRetired = "SELECT EXISTS (SELECT 1 FROM %[3]s WHERE consumer = ? AND family_kind = ? AND family_id = ? AND order_key = ?)"

	// myFamilyPurge deletes at most ? rows idle for longer than ?
	// microseconds by the server's clock in UTC (as stored). Unlike
	// PostgreSQL it waits for rows a writer holds (no SKIP LOCKED in
	// DELETE); idle rows are rarely locked.
	myFamilyPurge = "DELETE FROM %[1]s WHERE updated_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND ORDER BY updated_at LIMIT ?"
)

// myFamilyLock is a session-level named lock (GET_LOCK with no wait), per
// database and pair of tables; SHA1 keeps the name within MySQL's 64
// characters.
func myFamilyLock(ctx context.Context, conn sqldb.Conn, name string) (func(), bool, error) {
	const lockName = "CONCAT('idem-family-purge:', SHA1(CONCAT(DATABASE(), ':', ?)))"
	var got *int64
	if err := conn.QueryRow(ctx, "SELECT GET_LOCK("+lockName+", 0)", name).Scan(&got); err != nil {
		return nil, false, err
	}
	if got == nil || *got != 1 {
		return nil, false, nil
	}
	return func() {
		uctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		var released *int64
		_ = conn.QueryRow(uctx, "SELECT RELEASE_LOCK("+lockName+")", name).Scan(&released)
	}, true, nil
}

// SQLite 3.35+. One writer at a time: the upserts need no row lock to be
// serialised, the writer's transaction holds the database's. updated_at is
// sqldb.SQLiteTimeLayout text (UTC, microseconds) from the process clock,
// the last parameter of each write (sqldb.SQLiteNow): SQLite's
// strftime('now') has millisecond resolution and read earlier than a Go
// clock read just before the statement.
const (
	liteFamilyAdvance = `INSERT INTO %[1]s (family_kind, family_id, order_key, event_id, seq, occurred_at, updated_at)
VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)
ON CONFLICT (family_kind, family_id) DO UPDATE
SET order_key = excluded.order_key, event_id = excluded.event_id, seq = excluded.seq,
    occurred_at = excluded.occurred_at, updated_at = excluded.updated_at
WHERE order_key < excluded.order_key
RETURNING 1`

	liteFamilyLatest = `SELECT order_key FROM %[1]s WHERE family_kind = ? AND family_id = ?`

	liteFamilyApplied = `INSERT INTO %[2]s (consumer, family_kind, family_id, order_key, event_id, updated_at)
VALUES (?1, ?2, ?3, ?4, ?5, ?6)
ON CONFLICT (consumer, family_kind, family_id) DO UPDATE
SET order_key = excluded.order_key, event_id = excluded.event_id,
    updated_at = excluded.updated_at
WHERE order_key < excluded.order_key
RETURNING 1`

	liteFamilyNewer = `SELECT EXISTS (SELECT 1 FROM %[1]s l WHERE l.family_kind = ? AND l.family_id = ? AND l.order_key > ?
    AND NOT EXISTS (SELECT 1 FROM %[3]s r WHERE r.consumer = ? AND r.family_kind = l.family_kind
                    AND r.family_id = l.family_id AND r.order_key = l.order_key))`

	liteFamilyRetire = `INSERT INTO %[3]s (consumer, family_kind, family_id, order_key, event_id, updated_at)
VALUES (?1, ?2, ?3, ?4, ?5, ?6)
ON CONFLICT (consumer, family_kind, family_id) DO UPDATE
SET order_key = excluded.order_key, event_id = excluded.event_id,
    updated_at = excluded.updated_at
WHERE order_key < excluded.order_key`

	liteFamilyRetired = `SELECT EXISTS (SELECT 1 FROM %[3]s WHERE consumer = ? AND family_kind = ? AND family_id = ? AND order_key = ?)`

	// liteFamilyPurge: %[1]s the table, %[2]s its primary key columns;
	// parameters: the cutoff (the process clock minus the horizon), the
	// limit.
	liteFamilyPurge = `DELETE FROM %[1]s WHERE (%[2]s) IN (
    SELECT %[2]s FROM %[1]s
    WHERE updated_at < ?1
    ORDER BY updated_at LIMIT ?2)`
)

// liteFamilyLock is a lock of the process per database file and name
// (SQLite has no session locks; one process per file).
func liteFamilyLock(ctx context.Context, conn sqldb.Conn, name string) (func(), bool, error) {
	return purgeloop.SQLiteProcessLock("versioned:"+name)(ctx, conn)
}
