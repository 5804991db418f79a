package operation

import (
	"fmt"

	"github.com/google/uuid"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// dialectSQL is one dialect's statements and ways (one file per dialect:
// sql_postgres.go, sql_mysql.go, sql_sqlite.go). In each statement %[1]s is
// the quoted table and %[2]s the record columns recordScan reads.
//
// The Runner passes every statement its arguments in one canonical order,
// the PostgreSQL statements' $1, $2, …:
//
//	peek, get  key
//	claim      key, owner, kind, fingerprint
//	take       key, owner, to state, from state, previous owner (or NULL)
//	succeed    key, owner, reference, result
//	fail       key, owner, reference, error
//	uncertain  key, owner, reference, error
//	release    key, owner, error
//	restart    key, owner
//	resolve    key, state, owner (or NULL), reference, result (or NULL), reason, final (bool)
//
// SQLite's numbered parameters (?1, ?2, …) take them as they come; MySQL's
// ? cannot be numbered, so its statements say in which order they use them
// (stmt.order).
type dialectSQL struct {
	columns string

	peek, claim, take, succeed, fail, uncertain, release, restart, resolve, get stmt

	// beat renews the lease of a started record this attempt owns (its
	// updated_at; $1 key, $2 owner): 0 rows means ownership lost. alive
	// reads whether a record's lease is live ($1 key, $2 the lease in
	// microseconds). Empty where the key's lock belongs to the process
	// (SQLite): no session to lose.
	beat, alive stmt

	// claimReturns: claim returns (inserted, record columns…) in one
	// statement (PostgreSQL). Otherwise claim inserts the started row or
	// does nothing, and get reads the record: under the key's lock nothing
	// else writes the row in between, and the row is ours exactly when its
	// owner is this attempt's fresh token.
	claimReturns bool
	// returning: take returns the new attempts count and uncertain the
	// reference (RETURNING). Otherwise they report rows affected and the
	// Runner reads what it needs under the key's lock.
	returning bool
	// owner binds an owner token (uuid for PostgreSQL, 16 bytes elsewhere).
	owner func(uuid.UUID) any
	// locker is the key's lock.
	locker keyLocker
}

// stmt is one statement and, for MySQL, the order in which its ?
// placeholders use the canonical arguments (nil: as passed).
type stmt struct {
	sql   string
	order []int
	// clock: the statement takes the process clock (sqldb.SQLiteNow) as
	// one more parameter after the canonical ones (SQLite).
	clock bool
}

// args arranges the canonical arguments for s.
func (s stmt) args(in ...any) []any {
	if s.clock {
		return append(in[:len(in):len(in)], sqldb.SQLiteNow())
	}
	if s.order == nil {
		return in
	}
	out := make([]any, len(s.order))
	for i, n := range s.order {
		out[i] = in[n]
	}
	return out
}

// render fills in the table and columns of every statement.
func (d dialectSQL) render(table string) dialectSQL {
	for _, s := range []*stmt{&d.peek, &d.claim, &d.take, &d.succeed, &d.fail, &d.uncertain, &d.release, &d.restart, &d.resolve, &d.get, &d.beat, &d.alive} {
		if s.sql != "" {
			s.sql = fmt.Sprintf(s.sql, table, d.columns)
		}
	}
	return d
}

func sqlFor(d sqldb.Dialect) dialectSQL {
	switch d {
	case sqldb.MySQL:
		return mysqlSQL
	case sqldb.SQLite:
		return sqliteSQL
	default:
		return postgresSQL
	}
}
