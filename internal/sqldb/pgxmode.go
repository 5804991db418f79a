package sqldb

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// OwnMode is the exec mode of the library's own statements on a user's pgx
// pool, those it runs outside any transaction of the user's (the
// migrations, the table's replay horizon, NewConsumer's checks, the
// purgers, the family store's reads on LatestDB and retirements on
// RetireDB, the outbox's relay and reads, the crash count; not the claim
// or the handler's statements): pgx.QueryExecModeExec, or nil
// (the pool's default) when that is pgx.QueryExecModeExec or
// pgx.QueryExecModeSimpleProtocol already. Both send a statement in one
// round trip and leave no named statement on the server, so a
// transaction pooler (PgBouncer before 1.21, or with
// max_prepared_statements = 0) may give each statement another server
// connection. The other modes may not: pgx's default,
// QueryExecModeCacheStatement, runs a statement it prepared on one server
// connection on another (26000) or prepares a name another client's
// statement holds there (42P05), and QueryExecModeDescribeExec describes in
// one round trip and binds the unnamed statement in a second one, which
// outside a transaction may reach another server connection (26000, or
// another client's statement). The pool's mode is the user's choice and
// these statements share the pool. In QueryExecModeExec the parameters go
// as text of unknown type, typed by the server from where they stand, and
// the results come back as text; the price is a parse and plan on the
// server per statement.
func OwnMode(pool *pgxpool.Pool) any {
	return ownMode(pool.Config().ConnConfig.DefaultQueryExecMode)
}

// OwnModeIn is OwnMode for a statement of the library's own inside a
// transaction on conn (the crash count's end, written with the claim):
// behind a transaction pooler a named statement of pgx's cache fails
// there too (26000, 42P05), and aborts the transaction.
func OwnModeIn(conn *pgx.Conn) any {
	return ownMode(conn.Config().DefaultQueryExecMode)
}

func ownMode(m pgx.QueryExecMode) any {
	switch m {
	case pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol:
		return nil
	}
	return pgx.QueryExecModeExec
}

// WithMode returns args with mode first (pgx reads a leading
// pgx.QueryExecMode as the statement's mode), or args when mode is nil.
func WithMode(mode any, args []any) []any {
	if mode == nil {
		return args
	}
	return append([]any{mode}, args...)
}

// PgxIn is Pgx sending every statement in mode (OwnMode); with a nil mode
// it is Pgx.
func PgxIn(q PgxQuerier, mode any) Querier {
	if mode == nil {
		return Pgx(q)
	}
	return pgxModeQuerier{q, mode}
}

type pgxModeQuerier struct {
	q    PgxQuerier
	mode any
}

func (p pgxModeQuerier) Exec(ctx context.Context, query string, args ...any) (int64, error) {
	return pgxQuerier{p.q}.Exec(ctx, query, WithMode(p.mode, args)...)
}

func (p pgxModeQuerier) QueryRow(ctx context.Context, query string, args ...any) Row {
	return pgxQuerier{p.q}.QueryRow(ctx, query, WithMode(p.mode, args)...)
}
