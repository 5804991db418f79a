package processedstore

import (
	"fmt"
	"strings"
	"sync"

	"github.com/google/uuid"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// guardStatements is the commit guard's SQL (PostgreSQL only), per table.
type guardStatements struct {
	main, other string
	// schemas caches the statements per schema for an unqualified table
	// (ClaimGuardQuery); nil on a copy.
	schemas *sync.Map
}

// guardSQL checks that the claim row of ($1 consumer, $2 event_id) was
// inserted by the transaction the statement runs in: its xmin is the
// transaction's own id (pg_current_xact_id_if_assigned, PostgreSQL 13+;
// NULL outside a transaction or in one that wrote nothing). When it was
// not, count(*) is 0 and the statement fails with 22012
// (division_by_zero), which aborts the transaction: a COMMIT sent after it
// in the same pipeline then does not commit. The comment names the cause
// in the server's log.
// Its second argument is the row's key condition (tableKey, or
// <table>_v7's).
const guardSQL = `/* idempotency commit guard: fails unless this transaction made the claim */ SELECT 1 / count(*) FROM %s WHERE %s AND xmin = pg_current_xact_id_if_assigned()::xid`

// tableKey is the table's key condition on $1 the consumer, $2 the event id.
const tableKey = "consumer = $1 AND event_id = $2"

func newGuardStatements(s *Store) guardStatements {
	if s.dialect != sqldb.PostgreSQL {
		return guardStatements{}
	}
	g := guardStatements{main: fmt.Sprintf(guardSQL, s.table.Quoted('"'), tableKey), schemas: &sync.Map{}}
	if s.layout == LayoutPartitioned {
		g.other = fmt.Sprintf(guardSQL, s.sibling("other"), tableKey)
	}
	return g
}

// GuardFailed is the SQLSTATE with which ClaimGuardQuery's statement
// reports that the claim is not the current transaction's (22012,
// division_by_zero, raised on purpose).
const GuardFailed = "22012"

// ClaimGuardSchemaQuery returns, on PostgreSQL for an unqualified table,
// the statement (no parameters) that selects the schema the table resolves
// to through the session's search_path, so that the guard names the table
// the claim used even when a handler changes search_path (SET LOCAL, the
// schema-per-tenant pattern) before it runs. ok is false for a qualified
// table and on the other dialects: ClaimGuardQuery then needs no schema.
func (s *Store) ClaimGuardSchemaQuery() (query string, ok bool) {
	if s.guard.main == "" || s.table.Qualified() {
		return "", false
	}
	return `SELECT n.nspname FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = to_regclass('` + s.table.Quoted('"') + `')`, true
}

// ClaimGuardQuery returns, on PostgreSQL, the statement that checks, in
// the transaction that is about to commit, that this transaction is the
// one whose claim inserted consumer's row of eventID (ok is false on the other
// dialects). Its parameters are $1 the consumer (text) and $2 the event id
// (uuid). schema, when not "", qualifies an unqualified table (see
// ClaimGuardSchemaQuery). It selects 1 when it is; when it is not (a
// statement of the handler ended the claim's transaction: ROLLBACK, or
// COMMIT, and maybe BEGIN again) it fails with SQLSTATE GuardFailed and
// aborts the transaction. One primary-key lookup of a row the transaction
// wrote; no lock.
func (s *Store) ClaimGuardQuery(consumer string, eventID uuid.UUID, schema string) (query string, ok bool) {
	if s.guard.main == "" {
		return "", false
	}
	g := s.guard
	if schema != "" && !s.table.Qualified() {
		if v, ok := s.guard.schemas.Load(schema); ok {
			g = v.(guardStatements)
		} else {
			g = s.guardIn(schema)
			s.guard.schemas.Store(schema, g)
		}
	}
	if s.routed(eventID) {
		return g.other, true
	}
	if s.inV7(eventID) { // a qualified table: no schema variants
		return s.v7Read(consumer).guard, true
	}
	return g.main, true
}

// guardIn is the guard's statements on the table in schema.
func (s *Store) guardIn(schema string) guardStatements {
	q := `"` + strings.ReplaceAll(schema, `"`, `""`) + `".`
	g := guardStatements{main: fmt.Sprintf(guardSQL, q+s.table.Quoted('"'), tableKey)}
	if s.layout == LayoutPartitioned {
		id, _ := sqldb.ParseIdent(s.table.Name() + "_other")
		g.other = fmt.Sprintf(guardSQL, q+id.Quoted('"'), tableKey)
	}
	return g
}
