package operation

import "github.com/google/uuid"

// sqliteSQL is every SQLite 3.35+ statement of the operations table, with
// numbered parameters in the canonical order (see dialectSQL). SQLite has
// no data-modifying CTE: the claim is an insert then a read. Times are
// sqldb.SQLiteTimeLayout text (UTC, microseconds) from the process clock:
// the statements marked clock take it as one more parameter after the
// canonical ones (SQLite's strftime('now') has millisecond resolution and
// read earlier than a Go clock read just before the statement). The key's
// lock belongs to the process (processLocker).
var sqliteSQL = dialectSQL{
	columns: `"key", kind, fingerprint, state, reference, result, error, attempts, owner, created_at, updated_at`,

	peek: stmt{sql: `SELECT fingerprint FROM %[1]s WHERE "key" = ?1`},

	claim: stmt{sql: `INSERT INTO %[1]s ("key", owner, kind, fingerprint, state, attempts, created_at, updated_at)
VALUES (?1, ?2, ?3, ?4, 'started', 1, ?5, ?5) ON CONFLICT ("key") DO NOTHING`, clock: true},

	take: stmt{sql: `UPDATE %[1]s SET owner = ?2, attempts = attempts + 1, state = ?3,
    updated_at = ?6
WHERE "key" = ?1 AND state = ?4 AND owner IS ?5
RETURNING attempts`, clock: true},
	returning: true,

	succeed: stmt{sql: `UPDATE %[1]s SET state = 'succeeded', reference = NULLIF(?3, ''), result = ?4,
    updated_at = ?5, finished_at = ?5
WHERE "key" = ?1 AND owner = ?2 AND state IN ('started', 'uncertain')`, clock: true},

	fail: stmt{sql: `UPDATE %[1]s SET state = 'failed', reference = COALESCE(NULLIF(?3, ''), reference), error = ?4,
    updated_at = ?5, finished_at = ?5
WHERE "key" = ?1 AND owner = ?2 AND state IN ('started', 'uncertain')`, clock: true},

	uncertain: stmt{sql: `UPDATE %[1]s SET state = 'uncertain', reference = COALESCE(NULLIF(?3, ''), reference), error = ?4,
    updated_at = ?5
WHERE "key" = ?1 AND owner = ?2 AND state = 'started'
RETURNING COALESCE(reference, '')`, clock: true},

	release: stmt{sql: `UPDATE %[1]s SET owner = NULL, error = ?3, updated_at = ?4
WHERE "key" = ?1 AND owner = ?2 AND state = 'started'`, clock: true},

	restart: stmt{sql: `UPDATE %[1]s SET state = 'started', updated_at = ?3
WHERE "key" = ?1 AND owner = ?2 AND state = 'uncertain'`, clock: true},

	resolve: stmt{sql: `UPDATE %[1]s SET state = ?2, owner = ?3,
    reference = COALESCE(NULLIF(?4, ''), reference),
    result = COALESCE(?5, result),
    error = COALESCE(NULLIF(?6, ''), error),
    updated_at = ?8,
    finished_at = CASE WHEN ?7 THEN ?8 END
WHERE "key" = ?1 AND state IN ('started', 'uncertain')`, clock: true},

	get: stmt{sql: `SELECT %[2]s FROM %[1]s WHERE "key" = ?1`},

	owner:  func(id uuid.UUID) any { b := id; return b[:] },
	locker: processLocker{},
}
