package processed

import (
	"fmt"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgtype"
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
	// The claim with the replay window: an event dated before now() minus
	// the horizon or after now() plus the future skew (microseconds, from
	// the store's config) inserts nothing. now() is the transaction's start
	// on the server: the same clock and instant as the purge's cutoff and
	// as Verdict's, which runs in the same transaction.
	window: `INSERT INTO %[1]s (consumer, event_id, event_at)
SELECT $1, $2, coalesce($3::timestamptz, now())
WHERE $3::timestamptz IS NULL
   OR $3::timestamptz BETWEEN now() - interval '%[2]d microseconds' AND now() + interval '%[3]d microseconds'
ON CONFLICT DO NOTHING`,
	verdict: `SELECT EXISTS (SELECT 1 FROM %[1]s WHERE consumer = $1 AND event_id = $2),
       $3::timestamptz < now() - interval '%[2]d microseconds',
       to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')`,
	eventAt: func(t time.Time) any { return t },
	exists:  `SELECT EXISTS (SELECT 1 FROM %[1]s WHERE consumer = $1 AND event_id = $2)`,
	// The purge of a table with a full event_at index (the partitioned
	// layout's default partition and side table; the plain layout uses
	// postgresPlainPurge).
	// Deletes at most $2 rows dated (event_at) before the database clock minus $1
	// microseconds. now() is the server's transaction start, so neither the
	// process's TZ nor the session's timezone enters the cutoff; a
	// microsecond interval has no calendar (DST) component. Rows locked by a
	// concurrent transaction are skipped, never waited on. Rows are keyed by
	// the primary key, never by ctid: a ctid is unique only within one
	// physical table, so on a partitioned table (range or hash) it repeats
	// across partitions and a ctid list deletes rows of other partitions.
	purgeBatch: `DELETE FROM %[1]s WHERE (consumer, event_id) IN (
    SELECT consumer, event_id FROM %[1]s
    WHERE event_at < now() - ($1::bigint * interval '1 microsecond')
    LIMIT $2
    FOR UPDATE SKIP LOCKED)`,
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

// postgresCutoff is the purge's cutoff: the database clock (the
// transaction's start) minus $1 microseconds, as postgresSQL.purgeBatch.
const postgresCutoff = `(now() - ($1::bigint * interval '1 microsecond'))`

// postgresV7Bound is the smallest UUID whose 48-bit UUIDv7 millisecond
// prefix (RFC 9562 §5.7) is one past the cutoff's millisecond: a UUIDv7
// sorts below it exactly when its millisecond is at most the cutoff's.
// extract(epoch …) is exact (numeric, microseconds) on PostgreSQL 14+.
const postgresV7Bound = `(lpad(to_hex(floor(extract(epoch FROM ` + postgresCutoff + `) * 1000)::bigint + 1), 12, '0') || '00000000000000000000')::uuid`

// postgresNonV7 is the predicate of the plain layout's event_at index
// (migrations/postgres/0004_event_at_partial.up.sql), %[1]s the column's
// qualifier: true for an id that is not a UUIDv7 (version nibble, byte 6)
// and for a UUIDv7 row dated before its id's millisecond; false for a row
// the claim writes for a UUIDv7 (event_at = the id's time), which therefore
// enters no secondary index. It is written exactly as in the migration so
// that the planner proves the index usable.
const postgresNonV7 = `(get_byte(uuid_send(%[1]sevent_id), 6) >> 4 <> 7
           OR %[1]sevent_at < to_timestamp(('x' || encode(substring(uuid_send(%[1]sevent_id) FROM 1 FOR 6), 'hex'))::bit(48)::bigint / 1000.0::float8))`

// postgresPlainPurge is the plain layout's purge batch (%[1]s the quoted
// table; $1 the horizon in microseconds, $2 the batch limit, as
// postgresSQL.purgeBatch): it deletes at most $2 rows whose event_at is
// before the cutoff, found by two disjoint access paths,
//
//   - per consumer, a primary-key range: event_id below postgresV7Bound and
//     event_at < cutoff, oldest id first. The consumers come from a skip
//     scan over the primary key (a recursive CTE, one index descent per
//     consumer). Every row the claim writes for a UUIDv7 is found here once
//     it expires: its event_at is its id's millisecond, so event_at < cutoff
//     puts the id below the bound. The event_at test keeps every unexpired
//     row (an id of the cutoff's millisecond, or any id that sorts low).
//   - the partial event_at index (postgresNonV7): rows at or above the
//     bound with event_at < cutoff, i.e. ids that are not UUIDv7 and UUIDv7
//     rows dated before their id's time.
//
// A row expired by event_at is in exactly one of the two. Rows locked by
// a concurrent transaction are skipped (FOR UPDATE SKIP LOCKED), never
// waited on; rows are keyed by the primary key, never by ctid (see
// postgresSQL.purgeBatch). The cutoff and the bound are written inline (not
// in a CTE) so that the planner estimates them from the database clock.
var postgresPlainPurge = `DELETE FROM %[1]s WHERE (consumer, event_id) IN (
WITH RECURSIVE c AS (
    (SELECT consumer FROM %[1]s ORDER BY consumer LIMIT 1)
    UNION ALL
    SELECT (SELECT n.consumer FROM %[1]s n WHERE n.consumer > c.consumer ORDER BY n.consumer LIMIT 1)
    FROM c WHERE c.consumer IS NOT NULL
)
SELECT u.consumer, u.event_id FROM (
    SELECT * FROM (SELECT r.consumer, r.event_id FROM c, LATERAL (
        SELECT p.consumer, p.event_id FROM %[1]s p
        WHERE p.consumer = c.consumer AND p.event_id < ` + postgresV7Bound + `
          AND p.event_at < ` + postgresCutoff + `
        ORDER BY p.event_id
        LIMIT $2 FOR UPDATE OF p SKIP LOCKED) AS r) AS a
    UNION ALL
    SELECT * FROM (SELECT o.consumer, o.event_id FROM %[1]s o
    WHERE ` + strings.ReplaceAll(postgresNonV7, "%[1]s", "o.") + `
      AND o.event_id >= ` + postgresV7Bound + `
      AND o.event_at < ` + postgresCutoff + `
    LIMIT $2 FOR UPDATE OF o SKIP LOCKED) AS b
) AS u LIMIT $2)`
