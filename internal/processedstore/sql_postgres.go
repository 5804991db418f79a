package processedstore

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// postgresSQL is every PostgreSQL statement of the store; %[1]s is the quoted
// table. $1 is the consumer (text), $2 the event_id (uuid) where present.
var postgresSQL = dialectSQL{
	// The claim: one statement, one round trip. Zero rows affected means
	// the (consumer, event_id) row exists (committed by someone else, or
	// committed after we waited on its uncommitted insert): a duplicate. A
	// unique violation is never raised, so the transaction is never aborted
	// (catching 23505 would leave it in state 25P02).
	// $3 is the event's time (NULL: unknown, dated now()).
	claim: `INSERT INTO %[1]s (consumer, event_id, event_at) VALUES ($1, $2, coalesce($3::timestamptz, now())) ON CONFLICT DO NOTHING`,
	// The claim with the replay window: an event dated before the
	// statement's start (statement_timestamp()) minus the horizon or after
	// it plus the future skew (microseconds, from the store's config)
	// inserts nothing. The statement's start, not the transaction's
	// (now()): a claim in a transaction opened long before (watermill-sql's
	// subscriber batch) is judged when it runs, on the same clock as the
	// purge's cutoff, which the purger keeps 5 minutes older
	// (purgeClaimSlack) for a claim that waits on a row being deleted.
	// Verdict's later start judges a refusal the same way.
	window: `INSERT INTO %[1]s (consumer, event_id, event_at)
SELECT $1, $2, coalesce($3::timestamptz, now())
WHERE $3::timestamptz IS NULL
   OR $3::timestamptz BETWEEN statement_timestamp() - interval '%[2]d microseconds' AND statement_timestamp() + interval '%[3]d microseconds'
ON CONFLICT DO NOTHING`,
	verdict: `SELECT EXISTS (SELECT 1 FROM %[1]s WHERE consumer = $1 AND event_id = $2),
       $3::timestamptz < statement_timestamp() - interval '%[2]d microseconds',
       to_char(statement_timestamp() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')`,
	eventAt: func(t time.Time) any { return t },
	exists:  `SELECT EXISTS (SELECT 1 FROM %[1]s WHERE consumer = $1 AND event_id = $2)`,
	// Deletes at most $2 rows dated (event_at) before the database clock minus $1
	// microseconds. now() is the server's transaction start, so neither the
	// process's TZ nor the session's timezone enters the cutoff; a
	// microsecond interval has no calendar (DST) component. Rows locked by a
	// concurrent transaction are skipped, never waited on. Rows are keyed by
	// the primary key, never by ctid: a ctid is unique only within one
	// physical table, so on a partitioned table (range or hash) it repeats
	// across partitions and a ctid list deletes rows of other partitions.
	//
	// Two kinds of rows expire (migration 0007): those with an event_at,
	// found through the partial event_at index, and UUIDv7 rows the lean
	// claim (postgresLeanClaim) wrote without one, whose time is their id:
	// for each consumer (a loose scan of the primary key), a range of the
	// primary key below the smallest UUIDv7 of the cutoff's millisecond
	// (RFC 9562 §5.7: the first 48 bits are Unix milliseconds, big-endian),
	// so a row goes only when its id's millisecond is before the cutoff's,
	// which the claim refuses. Only UUIDv7 rows without event_at are taken
	// from that range: an id of another version that sorts there is kept
	// unless its own event_at expired (one without event_at, written by a
	// release older than migration 0002, is never purged). At most $2 rows
	// in all.
	purgeBatch: `DELETE FROM %[1]s WHERE (consumer, event_id) IN (
    SELECT consumer, event_id FROM (
        SELECT consumer, event_id FROM (
            SELECT consumer, event_id FROM %[1]s
            WHERE event_at < now() - ($1::bigint * interval '1 microsecond')
            LIMIT $2
            FOR UPDATE SKIP LOCKED) AS dated
        UNION ALL
        SELECT x.consumer, x.event_id FROM (
            WITH RECURSIVE c(consumer) AS (
                SELECT min(consumer) FROM %[1]s
                UNION ALL
                SELECT (SELECT min(t.consumer) FROM %[1]s AS t WHERE t.consumer > c.consumer)
                FROM c WHERE c.consumer IS NOT NULL)
            SELECT consumer FROM c WHERE consumer IS NOT NULL) AS c
        CROSS JOIN LATERAL (
            SELECT consumer, event_id FROM %[1]s AS t
            WHERE t.consumer = c.consumer
              AND t.event_id < (lpad(to_hex(greatest(0, floor(extract(epoch FROM now() - ($1::bigint * interval '1 microsecond')) * 1000))::bigint), 12, '0') || '00000000000000000000')::uuid
              AND t.event_at IS NULL
              AND get_byte(uuid_send(t.event_id), 6) >> 4 = 7
            LIMIT $2
            FOR UPDATE SKIP LOCKED) AS x
    ) AS expired
    LIMIT $2)`,
	purgeArgs: func(h time.Duration, limit int) []any { return []any{h.Microseconds(), limit} },
	// Sets lock_timeout for the current transaction only (SET LOCAL). A
	// utility statement with the value written into its text (whole
	// milliseconds, formatted from a Duration: nothing to quote) costs the
	// server about half of SELECT set_config($1, …, true), which starts an
	// executor (measured with cachegrind, issue 17).
	lockTimeout: func(d time.Duration) (string, []any) {
		return fmt.Sprintf("SET LOCAL lock_timeout = '%dms'", d.Milliseconds()), nil
	},
	// A session-level advisory lock held by the purging connection for one
	// run. Its key is the table's OID ($1 is the quoted name, resolved
	// through the search_path, so tables of one name in different schemas
	// have different locks) under a constant high word that keeps it apart
	// from other advisory-lock users.
	tryLock: `SELECT pg_try_advisory_lock((x'1de0'::bigint << 32) | $1::regclass::oid::bigint)`,
	unlock:  `SELECT pg_advisory_unlock((x'1de0'::bigint << 32) | $1::regclass::oid::bigint)`,
	eventID: func(id uuid.UUID) any { return pgtype.UUID{Bytes: id, Valid: true} },
}

// postgresLeanClaim is the claim the pgx beginner prepares (ClaimParamsAt)
// on the plain layout, for q, the quoted table: the same single INSERT …
// SELECT … WHERE … ON CONFLICT DO NOTHING with the same parameters ($1
// consumer, $2 event id, $3 event time or NULL; with identity $4 event
// name, $5 fingerprint) and the same replay window on the database clock,
// but a UUIDv7 row is written without event_at (v7): the column's default
// applies, none on the plain layout since migration 0007 (NULL), so the
// partial event_at index skips the row (8k server instructions and 75 B of
// WAL a claim, issue 25); its time is its id (RFC 9562 §5.7), which orders
// the primary key, and the purge reads it there. A table without migration
// 0007 dates it with its default, now(): kept at least as long. A UUIDv7
// always has a time, so its window has no IS NULL arm (2k).
//
// Measured and not kept: the window as a CASE on the consumer (a refusal
// by the NOT NULL column's error) cost the same as the WHERE; as a
// RETURNING column, 15k more (a row description and an output function
// per execution).
//
// Without future, the window has only its past arm (event time ≥
// statement_timestamp() − horizon): the claim of an event its sender knows
// is dated before the database clock plus the skew (ClaimParams.SQLNear),
// 3k server instructions less (issue 25).
func postgresLeanClaim(q string, v7, identity, future bool, horizon, skew time.Duration) string {
	cols, sel := "consumer, event_id, event_at", "$1, $2, coalesce($3::timestamptz, now())"
	if v7 {
		cols, sel = "consumer, event_id", "$1, $2"
	}
	if identity {
		cols, sel = cols+", event_name, fingerprint", sel+", $4, $5"
	}
	return leanInsert(q, cols, sel, leanWindow(v7, future, horizon, skew))
}

// leanWindow is a lean claim's condition on the event time $3: the replay
// window on the database clock (with future, both arms; without, the past
// arm only); without a horizon none, $3 still typed (the planner folds
// the condition to true). Only a UUIDv7 (v7) always has a time: an event
// without one ($3 NULL) is never refused.
func leanWindow(v7, future bool, horizon, skew time.Duration) string {
	if horizon <= 0 {
		return "$3::timestamptz IS NULL OR true"
	}
	where := fmt.Sprintf("$3::timestamptz BETWEEN statement_timestamp() - interval '%d microseconds' AND statement_timestamp() + interval '%d microseconds'",
		horizon.Microseconds(), skew.Microseconds())
	if !future {
		where = fmt.Sprintf("$3::timestamptz >= statement_timestamp() - interval '%d microseconds'", horizon.Microseconds())
	}
	if !v7 {
		where = "$3::timestamptz IS NULL OR " + where
	}
	return where
}

// leanInsert is a lean claim: INSERT INTO q (cols) SELECT sel under where
// (leanWindow), ON CONFLICT DO NOTHING.
func leanInsert(q, cols, sel, where string) string {
	return fmt.Sprintf("INSERT INTO %s (%s)\nSELECT %s%s%s)\nON CONFLICT DO NOTHING", q, cols, sel, leanClaimWhere, where)
}

// leanClaimWhere opens the lean claim's condition (postgresLeanClaim);
// LeanClaimWithLockTimeout inserts its setting before the parenthesis.
const leanClaimWhere = "\nWHERE ("

// LeanClaimWithLockTimeout returns sql, a lean claim's statement
// (postgresLeanClaim), with lock_timeout also set to d (whole
// milliseconds) for its transaction in its WHERE, evaluated before the row
// is inserted, so the wait on another transaction's claim of the same
// event and the rest of the transaction are bounded by d whatever the
// session's own setting. It is set (set_config, is_local) only when the
// session's setting is not d already: the pgx beginner makes d the
// session's setting, and a set_config makes PostgreSQL walk every setting
// at the transaction's end (about 10k server instructions a claim, issue
// 25); a CASE evaluates its arms in order. The claim's lock on its table
// is taken before any expression and is not bounded by it. ok is false
// when sql is not a lean claim.
func LeanClaimWithLockTimeout(sql string, d time.Duration) (string, bool) {
	i := strings.Index(sql, leanClaimWhere)
	if i < 0 {
		return "", false
	}
	i += len(leanClaimWhere) - 1
	ms := d.Milliseconds()
	return sql[:i] + "CASE WHEN current_setting('lock_timeout') = '" + millisText(ms) + "' THEN true ELSE set_config('lock_timeout', '" +
		strconv.FormatInt(ms, 10) + "ms', true) IS NOT NULL END AND " + sql[i:], true
}

// millisText is ms as PostgreSQL shows a setting in milliseconds
// (current_setting): in the largest of d, h, min, s and ms that divides
// it, "0" for 0.
func millisText(ms int64) string {
	if ms == 0 {
		return "0"
	}
	for _, u := range [...]struct {
		n    int64
		name string
	}{{86400000, "d"}, {3600000, "h"}, {60000, "min"}, {1000, "s"}, {1, "ms"}} {
		if ms%u.n == 0 {
			return strconv.FormatInt(ms/u.n, 10) + u.name
		}
	}
	return ""
}

// v7TimeSQL is the SQL of the UUIDv7 time of the uuid expression id: its
// first 48 bits as Unix milliseconds (RFC 9562 §5.7), a timestamptz. It is
// the time of a row the lean claim wrote without event_at.
func v7TimeSQL(id string) string {
	return "to_timestamp(('x' || lpad(left(replace(" + id + "::text, '-', ''), 12), 16, '0'))::bit(64)::bigint / 1000.0)"
}

// CheckLean turns the lean claim (postgresLeanClaim) off for a table
// whose event_at is still NOT NULL or which is partitioned: one that
// migration 0007 skipped (partitioned by its owner) or that a binary
// without 0007 migrated. There an omitted event_at takes the column's
// DEFAULT now(), the claim's time rather than the id's, and an id dated
// ahead of the database clock (within MaxFutureSkew) would be purged while
// the claim still accepts its redelivery. The classic claim writes the
// id's time instead. A missing table turns it off too (its first claim
// reports the missing table). NewConsumer calls it once, before the first
// claim; without it a store on the plain PostgreSQL layout claims lean.
//
// Where <table>_v7 exists (migration 0008) it also registers consumer
// (when not "") in <table>_consumer and, on a schema-qualified table whose
// <table>_v7 is ready (filled by Migrate), turns the UUIDv7 claim table on
// for it (useV7): its UUIDv7 claims go there and UUIDv7 rows are read
// there; otherwise, when the role may read <table>_v7, UUIDv7 rows are read
// in both tables.
func (s *Store) CheckLean(ctx context.Context, q sqldb.Querier, consumer string) error {
	if !s.hasLean {
		return nil
	}
	var off bool
	err := q.QueryRow(ctx, `SELECT coalesce((SELECT a.attnotnull OR c.relkind = 'p'
FROM pg_catalog.pg_attribute a JOIN pg_catalog.pg_class c ON c.oid = a.attrelid
WHERE a.attrelid = to_regclass($1) AND a.attname = 'event_at' AND NOT a.attisdropped), true)`, s.table.Quoted('"')).Scan(&off)
	if err != nil {
		return fmt.Errorf("processed: read the layout of %s: %w", s.table, err)
	}
	s.hasLean = !off
	return s.useV7(ctx, q, consumer)
}

// QualifiedTable returns table ("name", or "" for DefaultTable) as
// "schema.name" with the schema it resolves to through q's search_path now,
// on PostgreSQL; table as given when it is qualified already, when no such
// table exists yet (a consumer started before processed.Migrate) or when
// the schema's name is not a valid identifier (ParseIdent). NewConsumer
// uses it once, so that a handler's session-level SET search_path left on
// a pooled connection never moves a later claim, verdict or read to
// another schema's table; only a claim on a qualified table may commit
// without the commit guard's statement (ClaimParams.Pinned).
func QualifiedTable(ctx context.Context, q sqldb.Querier, d sqldb.Dialect, table string) (string, error) {
	if table == "" {
		table = DefaultTable
	}
	id, err := sqldb.ParseIdent(table)
	if d != sqldb.PostgreSQL || err != nil || strings.Contains(id.String(), ".") {
		return table, nil
	}
	var schema *string
	err = q.QueryRow(ctx, `SELECT (SELECT n.nspname FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = to_regclass($1))`, id.Quoted('"')).Scan(&schema)
	if err != nil {
		return "", fmt.Errorf("processed: find the schema of %s: %w", table, err)
	}
	if schema == nil {
		return table, nil
	}
	if _, err := sqldb.ParseIdent(*schema + "." + id.Name()); err != nil {
		return table, nil
	}
	return *schema + "." + id.Name(), nil
}
