package operation

import "github.com/google/uuid"

// sqliteSQL is every SQLite 3.35+ statement of the operations table, with
// numbered parameters in the canonical order (see dialectSQL). SQLite has
// no data-modifying CTE: the claim is an insert then a read. Times are UTC
// ISO 8601 text. The key's lock belongs to the process (processLocker).
var sqliteSQL = dialectSQL{
	columns: `"key", kind, fingerprint, state, reference, result, error, attempts, owner, created_at, updated_at`,

	peek: stmt{sql: `SELECT fingerprint FROM %[1]s WHERE "key" = ?1`},

	claim: stmt{sql: `INSERT INTO %[1]s ("key", owner, kind, fingerprint, state, attempts)
VALUES (?1, ?2, ?3, ?4, 'started', 1) ON CONFLICT ("key") DO NOTHING`},

	take: stmt{sql: `UPDATE %[1]s SET owner = ?2, attempts = attempts + 1, state = ?3,
    updated_at = strftime('%%Y-%%m-%%dT%%H:%%M:%%fZ', 'now')
WHERE "key" = ?1 AND state = ?4 AND owner IS ?5
RETURNING attempts`},
	returning: true,

	succeed: stmt{sql: `UPDATE %[1]s SET state = 'succeeded', reference = NULLIF(?3, ''), result = ?4,
    updated_at = strftime('%%Y-%%m-%%dT%%H:%%M:%%fZ', 'now'), finished_at = strftime('%%Y-%%m-%%dT%%H:%%M:%%fZ', 'now')
WHERE "key" = ?1 AND owner = ?2 AND state IN ('started', 'uncertain')`},

	fail: stmt{sql: `UPDATE %[1]s SET state = 'failed', reference = COALESCE(NULLIF(?3, ''), reference), error = ?4,
    updated_at = strftime('%%Y-%%m-%%dT%%H:%%M:%%fZ', 'now'), finished_at = strftime('%%Y-%%m-%%dT%%H:%%M:%%fZ', 'now')
WHERE "key" = ?1 AND owner = ?2 AND state IN ('started', 'uncertain')`},

	uncertain: stmt{sql: `UPDATE %[1]s SET state = 'uncertain', reference = COALESCE(NULLIF(?3, ''), reference), error = ?4,
    updated_at = strftime('%%Y-%%m-%%dT%%H:%%M:%%fZ', 'now')
WHERE "key" = ?1 AND owner = ?2 AND state = 'started'
RETURNING COALESCE(reference, '')`},

	release: stmt{sql: `UPDATE %[1]s SET owner = NULL, error = ?3, updated_at = strftime('%%Y-%%m-%%dT%%H:%%M:%%fZ', 'now')
WHERE "key" = ?1 AND owner = ?2 AND state = 'started'`},

	restart: stmt{sql: `UPDATE %[1]s SET state = 'started', updated_at = strftime('%%Y-%%m-%%dT%%H:%%M:%%fZ', 'now')
WHERE "key" = ?1 AND owner = ?2 AND state = 'uncertain'`},

	resolve: stmt{sql: `UPDATE %[1]s SET state = ?2, owner = ?3,
    reference = COALESCE(NULLIF(?4, ''), reference),
    result = COALESCE(?5, result),
    error = COALESCE(NULLIF(?6, ''), error),
    updated_at = strftime('%%Y-%%m-%%dT%%H:%%M:%%fZ', 'now'),
    finished_at = CASE WHEN ?7 THEN strftime('%%Y-%%m-%%dT%%H:%%M:%%fZ', 'now') END
WHERE "key" = ?1 AND state IN ('started', 'uncertain')`},

	get: stmt{sql: `SELECT %[2]s FROM %[1]s WHERE "key" = ?1`},

	owner:  func(id uuid.UUID) any { b := id; return b[:] },
	locker: processLocker{},
}
