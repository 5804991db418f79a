package operation

import (
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgtype"
)

// postgresSQL is every PostgreSQL statement of the operations table. $1 is
// always the key (text) where present, $2 the owner token (uuid) of the
// attempt, except in resolve (see dialectSQL).
var postgresSQL = dialectSQL{
	columns: `key, kind, fingerprint, state, reference, result, error, attempts, owner, created_at, updated_at`,

	// peek reads the fingerprint without the lock, while another worker
	// holds the key: a conflicting request is refused without waiting.
	peek: stmt{sql: `SELECT fingerprint FROM %[1]s WHERE key = $1`},

	// claim inserts the started record, or returns the existing one: one
	// statement, and the caller holds the key's lock, so the row read is not
	// moving. The SELECT branch reads the snapshot of this statement, taken
	// after the lock was granted, so it sees what the previous holder
	// committed before unlocking. ON CONFLICT DO NOTHING never raises 23505
	// (which would abort the transaction).
	claim: stmt{sql: `WITH ins AS (
    INSERT INTO %[1]s (key, kind, fingerprint, state, owner, attempts)
    VALUES ($1, $3, $4, 'started', $2, 1)
    ON CONFLICT (key) DO NOTHING
    RETURNING %[2]s
)
SELECT true, %[2]s FROM ins
UNION ALL
SELECT false, %[2]s FROM %[1]s WHERE key = $1 AND NOT EXISTS (SELECT 1 FROM ins)`},
	claimReturns: true,

	// take makes this attempt the owner of an existing record, moving it to
	// state $3, if it is still in state $4 with owner $5 as read under the
	// lock (a compare-and-set: 0 rows means it moved, which the lock rules
	// out unless someone edited the table by hand).
	take: stmt{sql: `UPDATE %[1]s SET owner = $2, attempts = attempts + 1, state = $3, updated_at = now()
WHERE key = $1 AND state = $4 AND owner IS NOT DISTINCT FROM $5
RETURNING attempts`},
	returning: true,

	// The outcome writes: each moves the row only if this attempt ($2) still
	// owns it. 0 rows: ownership lost.

	// succeed records success with the provider's reference and result.
	succeed: stmt{sql: `UPDATE %[1]s SET state = 'succeeded', reference = NULLIF($3, ''), result = $4,
    updated_at = now(), finished_at = now()
WHERE key = $1 AND owner = $2 AND state IN ('started', 'uncertain')`},

	// fail records a definite rejection.
	fail: stmt{sql: `UPDATE %[1]s SET state = 'failed', reference = COALESCE(NULLIF($3, ''), reference), error = $4,
    updated_at = now(), finished_at = now()
WHERE key = $1 AND owner = $2 AND state IN ('started', 'uncertain')`},

	// uncertain records that the call's outcome is unknown.
	uncertain: stmt{sql: `UPDATE %[1]s SET state = 'uncertain', reference = COALESCE(NULLIF($3, ''), reference), error = $4,
    updated_at = now()
WHERE key = $1 AND owner = $2 AND state = 'started'
RETURNING COALESCE(reference, '')`},

	// release gives the key back after a call that certainly had no
	// effect: started with no owner, so the next attempt calls again.
	release: stmt{sql: `UPDATE %[1]s SET owner = NULL, error = $3, updated_at = now()
WHERE key = $1 AND owner = $2 AND state = 'started'`},

	// restart moves an uncertain record back to started after the
	// reconcile function reported that the provider has no trace of it.
	restart: stmt{sql: `UPDATE %[1]s SET state = 'started', updated_at = now()
WHERE key = $1 AND owner = $2 AND state = 'uncertain'`},

	// resolve applies a Resolve verdict to a record that is started or
	// uncertain, under the key's lock: $2 the state, $3 the owner (NULL for
	// "not executed": the next Do calls), $4 the reference, $5 the result
	// (NULL but for a success; started and uncertain rows have none), $6 the
	// reason, $7 whether the state is final.
	resolve: stmt{sql: `UPDATE %[1]s SET state = $2, owner = $3,
    reference = COALESCE(NULLIF($4, ''), reference),
    result = COALESCE($5, result),
    error = COALESCE(NULLIF($6, ''), error),
    updated_at = now(),
    finished_at = CASE WHEN $7 THEN now() END
WHERE key = $1 AND state IN ('started', 'uncertain')`},

	// get reads one record.
	get:  stmt{sql: `SELECT %[2]s FROM %[1]s WHERE key = $1`},
	beat: stmt{sql: `UPDATE %[1]s SET updated_at = now() WHERE key = $1 AND owner = $2 AND state = 'started'`},
	// clock_timestamp(): the lease is judged at the statement's instant,
	// not at the start of the (short) begin transaction.
	alive: stmt{sql: `SELECT updated_at > clock_timestamp() - $2::bigint * interval '1 microsecond' FROM %[1]s WHERE key = $1`},

	owner:  func(id uuid.UUID) any { return pgtype.UUID{Bytes: id, Valid: true} },
	locker: pgLocker{},
}
