package processedstore

import (
	"fmt"

	"github.com/google/uuid"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// guardStatements is the commit guard's SQL (PostgreSQL only), per table.
type guardStatements struct{ main, other string }

// guardSQL checks that the claim row of ($1 consumer, $2 event_id) was
// inserted by the transaction the statement runs in: its xmin is the
// transaction's own id (pg_current_xact_id_if_assigned, PostgreSQL 13+;
// NULL outside a transaction or in one that wrote nothing). When it was
// not, count(*) is 0 and the statement fails with 22012
// (division_by_zero), which aborts the transaction: a COMMIT sent after it
// in the same pipeline then does not commit. The comment names the cause
// in the server's log.
const guardSQL = `SELECT 1 / count(*) /* idempotency commit guard: fails when the claim is not this transaction's */ FROM %s WHERE consumer = $1 AND event_id = $2 AND xmin = pg_current_xact_id_if_assigned()::xid`

func newGuardStatements(s *Store) guardStatements {
	if s.dialect != sqldb.PostgreSQL {
		return guardStatements{}
	}
	g := guardStatements{main: fmt.Sprintf(guardSQL, s.table.Quoted('"'))}
	if s.layout == LayoutPartitioned {
		g.other = fmt.Sprintf(guardSQL, s.sibling("other"))
	}
	return g
}

// GuardFailed is the SQLSTATE with which ClaimGuardQuery's statement
// reports that the claim is not the current transaction's (22012,
// division_by_zero, raised on purpose).
const GuardFailed = "22012"

// ClaimGuardQuery returns, on PostgreSQL, the statement that checks, in
// the transaction that is about to commit, that this transaction is the
// one whose claim inserted eventID's row (ok is false on the other
// dialects). Its parameters are $1 the consumer (text) and $2 the event id
// (uuid). It selects 1 when it is; when it is not (a statement of the
// handler ended the claim's transaction: ROLLBACK, or COMMIT, and maybe
// BEGIN again) it fails with SQLSTATE GuardFailed and aborts the
// transaction. One primary-key lookup of a row the transaction wrote; no
// lock.
func (s *Store) ClaimGuardQuery(eventID uuid.UUID) (query string, ok bool) {
	if s.guard.main == "" {
		return "", false
	}
	if s.routed(eventID) {
		return s.guard.other, true
	}
	return s.guard.main, true
}
