package processedstore

import (
	"fmt"
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
