package operation

import "github.com/google/uuid"

// mysqlSQL is every MySQL 8.0 / MariaDB 10.11 statement of the operations
// table (the same text for both). `key` is a reserved word there. MySQL has
// no RETURNING (MariaDB's INSERT … RETURNING is not MySQL's) and no
// numbered placeholders: the claim is an insert then a read, take and
// uncertain report rows affected, and each statement's order lists which
// canonical argument (see dialectSQL) each ? takes. Every outcome write
// changes state or owner, so rows affected is 1 whether or not the DSN
// counts found rows. The key's lock is GET_LOCK (myLocker).
var mysqlSQL = dialectSQL{
	columns: "`key`, kind, fingerprint, state, reference, result, error, attempts, owner, created_at, updated_at",

	peek: stmt{sql: "SELECT fingerprint FROM %[1]s WHERE `key` = ?"},

	// claim: the no-op update keeps a duplicate key from being an error
	// (INSERT IGNORE would also hide real errors).
	claim: stmt{sql: "INSERT INTO %[1]s (`key`, owner, kind, fingerprint, state, attempts)" +
		" VALUES (?, ?, ?, ?, 'started', 1) ON DUPLICATE KEY UPDATE `key` = `key`"},

	take: stmt{sql: "UPDATE %[1]s SET owner = ?, attempts = attempts + 1, state = ?, updated_at = UTC_TIMESTAMP(6)" +
		" WHERE `key` = ? AND state = ? AND owner <=> ?", order: []int{1, 2, 0, 3, 4}},

	succeed: stmt{sql: "UPDATE %[1]s SET state = 'succeeded', reference = NULLIF(?, ''), result = ?," +
		" updated_at = UTC_TIMESTAMP(6), finished_at = UTC_TIMESTAMP(6)" +
		" WHERE `key` = ? AND owner = ? AND state IN ('started', 'uncertain')", order: []int{2, 3, 0, 1}},

	fail: stmt{sql: "UPDATE %[1]s SET state = 'failed', reference = COALESCE(NULLIF(?, ''), reference), error = ?," +
		" updated_at = UTC_TIMESTAMP(6), finished_at = UTC_TIMESTAMP(6)" +
		" WHERE `key` = ? AND owner = ? AND state IN ('started', 'uncertain')", order: []int{2, 3, 0, 1}},

	uncertain: stmt{sql: "UPDATE %[1]s SET state = 'uncertain', reference = COALESCE(NULLIF(?, ''), reference), error = ?," +
		" updated_at = UTC_TIMESTAMP(6)" +
		" WHERE `key` = ? AND owner = ? AND state = 'started'", order: []int{2, 3, 0, 1}},

	release: stmt{sql: "UPDATE %[1]s SET owner = NULL, error = ?, updated_at = UTC_TIMESTAMP(6)" +
		" WHERE `key` = ? AND owner = ? AND state = 'started'", order: []int{2, 0, 1}},

	restart: stmt{sql: "UPDATE %[1]s SET state = 'started', updated_at = UTC_TIMESTAMP(6)" +
		" WHERE `key` = ? AND owner = ? AND state = 'uncertain'"},

	resolve: stmt{sql: "UPDATE %[1]s SET state = ?, owner = ?," +
		" reference = COALESCE(NULLIF(?, ''), reference), result = COALESCE(?, result)," +
		" error = COALESCE(NULLIF(?, ''), error), updated_at = UTC_TIMESTAMP(6)," +
		" finished_at = IF(?, UTC_TIMESTAMP(6), NULL)" +
		" WHERE `key` = ? AND state IN ('started', 'uncertain')", order: []int{1, 2, 3, 4, 5, 6, 0}},

	get: stmt{sql: "SELECT %[2]s FROM %[1]s WHERE `key` = ?"},

	beat:  stmt{sql: "UPDATE %[1]s SET updated_at = UTC_TIMESTAMP(6) WHERE `key` = ? AND owner = ? AND state = 'started'"},
	alive: stmt{sql: "SELECT updated_at > UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND FROM %[1]s WHERE `key` = ?", order: []int{1, 0}},

	owner:  func(id uuid.UUID) any { b := id; return b[:] },
	locker: myLocker{},
}
