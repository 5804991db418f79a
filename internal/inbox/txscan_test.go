package inbox

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
)

// Every way PostgreSQL lets a query string end a transaction block is
// seen as one that may (the guard's statement then runs); only statements
// that cannot end it pass.
func TestTxScanFlagsEveryStatementThatMayEndTheTransaction(t *testing.T) {
	ends := []string{
		"COMMIT", "commit", "  Commit ;", "END", "end transaction", "ROLLBACK", "rollback work",
		"ABORT", "PREPARE TRANSACTION 'x'", "COMMIT AND CHAIN", "ROLLBACK AND CHAIN",
		"INSERT INTO t VALUES (1); COMMIT", "insert into t values (1);commit;begin",
		"SELECT 1;\n\tROLLBACK", "select ';commit'", // a semicolon in a literal: unproven, never proven
		"/* x */ COMMIT", "-- x\nCOMMIT", "(SELECT 1)", "select1", "select_x", "select$",
		"SELECT\u00a0 1", "ROLLBACK TOO", "rollback/**/to sp", "EXECUTE s",
		"explain analyze select 1", "begin", "start transaction", "my_prepared_statement",
		"\ufeffSELECT 1", "VACUUM",
	}
	for _, sql := range ends {
		if !mayEndTx(sql) {
			t.Errorf("mayEndTx(%q) = false: a statement that may end the transaction passed", sql)
		}
	}
	keeps := []string{
		"", ";", " ; ;", "SELECT 1", "select(1)", "INSERT INTO effect (id) VALUES ($1)",
		"update stock set n = n - 1 where id = $1", "DELETE FROM t", "WITH x AS (SELECT 1) SELECT * FROM x",
		"MERGE INTO t USING s ON true WHEN MATCHED THEN DO NOTHING", "VALUES (1)", "TABLE t",
		"COPY t FROM STDIN", "TRUNCATE t", "SET LOCAL search_path = a", "SHOW lock_timeout",
		"LOCK TABLE t", "SAVEPOINT a", "RELEASE SAVEPOINT a", "ROLLBACK TO SAVEPOINT a",
		"rollback\tto a", "CALL p()", "DO $$ BEGIN NULL; END $$", // DO: the inner ';' splits: "END $$" may end
		"NOTIFY c", "LISTEN c", "UNLISTEN *", "\n\t\r\f\vselect 1", "insert into t values (1); update t set x = 2;",
	}
	for _, sql := range keeps {
		if sql == "DO $$ BEGIN NULL; END $$" {
			if !mayEndTx(sql) {
				t.Errorf("mayEndTx(%q) = false: the part after the inner semicolon starts with END", sql)
			}
			continue
		}
		if mayEndTx(sql) {
			t.Errorf("mayEndTx(%q) = true: a statement that keeps the transaction costs the guard", sql)
		}
	}
}

// pgx sends what a query rewriter returns, not the text the scan saw;
// its own named arguments only replace placeholders.
func TestTxScanDistrustsQueryRewritersButNamedArgs(t *testing.T) {
	if rewritesQuery([]any{pgx.NamedArgs{"a": 1}}) || rewritesQuery([]any{pgx.StrictNamedArgs{"a": 1}}) || rewritesQuery([]any{1, "x"}) || rewritesQuery(nil) {
		t.Fatal("named arguments or plain values taken for a rewriter")
	}
	if !rewritesQuery([]any{rewriter{}}) || !rewritesQuery([]any{pgx.QueryExecModeExec, rewriter{}}) {
		t.Fatal("a query rewriter of the handler's own was trusted")
	}
}

// pgx's simple protocol writes the arguments into the text it sends, by
// a lexer of its own (it differs from PostgreSQL's on dollar quotes and
// backslashes): every call with arguments in it is distrusted; with no
// arguments, or in the extended protocol, the text is sent as is.
func TestTxScanDistrustsEverySimpleProtocolCallWithArguments(t *testing.T) {
	simple := pgx.QueryExecModeSimpleProtocol
	for _, c := range []struct {
		sql  string
		args []any
	}{
		{"SELECT $q$ $1 $q$", []any{simple, "x"}},
		{"SELECT $$ $1 $$", []any{simple, "x"}},
		{"SELECT 1 $", []any{simple, "x"}},
		{"SELECT name'\\'\n' $1 '", []any{simple, "x"}},
		{"SELECT 1 -- \\\n, $1", []any{simple, "x"}},
		{"SELECT $q$ @v $q$", []any{simple, pgx.NamedArgs{"v": "x"}}},
		{"SELECT $a$ $1 $a$", []any{pgx.QueryResultFormats{1}, simple, 1}},
		{"INSERT INTO t VALUES ($1, $2, 'a''b', E'c')", []any{simple, 1, "x"}},
	} {
		if !sanitizesArguments(c.args) {
			t.Errorf("sanitizesArguments(%q, %v) = false", c.sql, c.args)
		}
	}
	for _, c := range []struct {
		sql  string
		args []any
	}{
		{"SELECT $q$ $1 $q$", nil},
		{"SELECT $q$;$q$", []any{simple}},
		{"SELECT $q$ $1 $q$", []any{pgx.QueryExecModeExec, "x"}},
		{"SELECT $q$ $1 $q$", []any{"x"}},
	} {
		if sanitizesArguments(c.args) {
			t.Errorf("sanitizesArguments(%q, %v) = true", c.sql, c.args)
		}
	}
}

// rewritesQuery and sanitizesArguments are scanArgs's two answers.
func rewritesQuery(args []any) bool { r, _ := scanArgs(args); return r }

func sanitizesArguments(args []any) bool { _, s := scanArgs(args); return s }

type rewriter struct{}

func (rewriter) RewriteQuery(ctx context.Context, conn *pgx.Conn, sql string, args []any) (string, []any, error) {
	return "COMMIT", nil, nil
}
