package inbox

import (
	"strings"

	"github.com/jackc/pgx/v5"
)

// Which handler statements keep the claim's transaction (issue 25). The
// commit guard (commitguard.go) catches a handler that ends the attempt's
// transaction by SQL, at the price of a statement before COMMIT (61.7k
// server instructions a message). On the pgx beginner's prepared path the
// handler's statements all pass through pgxTx, so their text tells
// whether any of them can end the transaction: PostgreSQL ends a
// transaction block only by a top-level COMMIT, END, ROLLBACK, ABORT or
// PREPARE TRANSACTION (a procedure or DO block called inside a block
// cannot: "invalid transaction termination"), and a statement starts only
// at the beginning of a query string or after a semicolon (a Parse
// message holds one statement; a simple query splits at semicolons). So
// when every statement of the attempt begins, at each of those places,
// with a keyword of keepsTxKeywords, COMMIT goes alone; otherwise, or
// when the handler reached the connection itself (pgxTx.Conn) or used a
// query rewriter of its own, the guard's statement decides.
//
// The scan errs one way only: a semicolon inside a literal, a comment or
// a parenthesis first makes a statement unproven (the guard then runs),
// never proven. Its limit: a statement prepared outside the handler's
// transaction (a pool's AfterConnect) whose name reads as such a keyword
// is trusted by its name, as pgx executes a prepared statement named by
// the query string.

// keepsTxKeywords are the first keywords of statements that never end a
// transaction block: DML, settings, savepoints, locks, CALL and DO (whose
// code may not commit inside a block), notifications. "rollback" is kept
// only as ROLLBACK TO (mayEndTx).
var keepsTxKeywords = [...]string{
	"select", "insert", "update", "delete", "merge", "with", "values", "table",
	"copy", "truncate", "set", "show", "lock", "savepoint", "release",
	"call", "do", "notify", "listen", "unlisten",
}

// mayEndTx reports whether sql, a handler's query string, may end the
// transaction it runs in: false only when each of its statements (split
// at every semicolon) is empty or starts, after ASCII white space, with a
// keyword of keepsTxKeywords or with ROLLBACK TO.
func mayEndTx(sql string) bool {
	for {
		stmt, rest, more := strings.Cut(sql, ";")
		if !keepsTx(stmt) {
			return true
		}
		if !more {
			return false
		}
		sql = rest
	}
}

// keepsTx reports whether stmt, one statement's text, starts with a
// keyword of keepsTxKeywords (or ROLLBACK TO), or is blank.
func keepsTx(stmt string) bool {
	i := skipSpace(stmt, 0)
	if i == len(stmt) {
		return true
	}
	word, j := keyword(stmt, i)
	if word == "" {
		return false
	}
	if strings.EqualFold(word, "rollback") {
		// ROLLBACK TO [SAVEPOINT] name undoes a savepoint's work only.
		k := skipSpace(stmt, j)
		if k == j {
			return false
		}
		next, _ := keyword(stmt, k)
		return strings.EqualFold(next, "to")
	}
	for _, kw := range keepsTxKeywords {
		if strings.EqualFold(word, kw) {
			return true
		}
	}
	return false
}

// skipSpace returns the index of the first byte of s at or after i that is
// not ASCII white space (PostgreSQL's lexer: space, \t, \n, \r, \f, \v).
func skipSpace(s string, i int) int {
	for i < len(s) {
		switch s[i] {
		case ' ', '\t', '\n', '\r', '\f', '\v':
			i++
		default:
			return i
		}
	}
	return i
}

// keyword returns the ASCII letters of s starting at i and the index after
// them; "" when there are none, or when an identifier character follows
// them (a digit, '_', '$' or a byte ≥ 0x80: then they are part of an
// identifier, not a keyword).
func keyword(s string, i int) (string, int) {
	j := i
	for j < len(s) && ('a' <= s[j]|0x20 && s[j]|0x20 <= 'z') {
		j++
	}
	if j == i {
		return "", i
	}
	if j < len(s) {
		c := s[j]
		if c >= 0x80 || c == '_' || c == '$' || ('0' <= c && c <= '9') {
			return "", i
		}
	}
	return s[i:j], j
}

// scanArgs reads a handler statement's arguments once. rewrites: they
// hold a pgx.QueryRewriter other than pgx's named arguments (which only
// replace @name placeholders), and pgx sends what the rewriter returns,
// not the text the scan saw. sanitizes: they select pgx's simple protocol
// (pgx.QueryExecModeSimpleProtocol) and hold values, which pgx writes as
// quoted literals into the query string with a lexer of its own. Where
// that lexer and PostgreSQL's disagree on what is inside a string, an
// argument's text runs as SQL: a dollar quote ($q$ $1 $q$: pgx knows
// none), a backslash after an identifier (name'\' is PostgreSQL's string
// '\'; to pgx an E string that goes on), and before pgx v5.5.4 a
// negative number after a minus sign (CVE-2024-27289). The guard's
// statement decides for every such call rather than for the cases known
// today.
func scanArgs(args []any) (rewrites, sanitizes bool) {
	simple, values := false, false
	for _, a := range args {
		switch a := a.(type) {
		case pgx.QueryExecMode:
			simple = simple || a == pgx.QueryExecModeSimpleProtocol
		case pgx.QueryResultFormats, pgx.QueryResultFormatsByOID:
		case pgx.NamedArgs, pgx.StrictNamedArgs: // before QueryRewriter: they are ones
			values = true
		case pgx.QueryRewriter:
			rewrites, values = true, true
		default:
			values = true
		}
	}
	return rewrites, simple && values
}
