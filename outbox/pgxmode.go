package outbox

import (
	"context"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// pgxMode is the exec mode of the outbox's own statements on pool (every
// statement of the relay, Pending, DeadLetters, Redrive and Replay; not the
// producer's insert, which runs in the producer's transaction and mode,
// where a prepared statement costs the server a quarter of a parsed one:
// 73k against 290k instructions): pgx.QueryExecModeExec whatever the
// pool's default, or nil (the pool's default) when that is
// pgx.QueryExecModeSimpleProtocol. Both send a statement in one round
// trip and leave no named statement on the server, so a transaction
// pooler (PgBouncer before 1.21, or with max_prepared_statements = 0)
// may give each statement another server connection. The other modes
// may not: pgx's default, QueryExecModeCacheStatement, runs a statement
// it prepared on one server connection on another (26000) or prepares a
// name another client's statement holds there (42P05), and
// QueryExecModeDescribeExec describes in one round trip and binds the
// unnamed statement in a second one, which outside a transaction may
// reach another server connection (26000, or another client's
// statement). A relay round failing after its publishes published its
// rows again. In QueryExecModeExec the parameters go as text of unknown
// type, typed by the server from where they stand: each of ours is
// compared with or assigned to a column, added to a bigint, or a LIMIT.
// The price is a parse and plan on the server per statement.
func pgxMode(pool *pgxpool.Pool) any {
	if pool.Config().ConnConfig.DefaultQueryExecMode == pgx.QueryExecModeSimpleProtocol {
		return nil
	}
	return pgx.QueryExecModeExec
}

// withMode returns args with mode first, or args when mode is nil.
func withMode(mode any, args []any) []any {
	if mode == nil {
		return args
	}
	return append([]any{mode}, args...)
}

// onPgx reports whether db is one of watermill-sql's pgx adapters, whose
// statements take a pgx.QueryExecMode as their first argument.
func onPgx(db wsql.ContextExecutor) bool {
	switch db.(type) {
	case wsql.PgxTx, *wsql.PgxTx, wsql.PgxBeginner, *wsql.PgxBeginner:
		return true
	}
	return false
}

// modePool is a pgx pool whose statements, in its transactions too, are
// sent in mode (wsql.BeginnerFromPgx takes it).
type modePool struct {
	pool *pgxpool.Pool
	mode any
}

var _ wsql.Conn = modePool{}

func (p modePool) BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error) {
	tx, err := p.pool.BeginTx(ctx, opts)
	if err != nil {
		return nil, err
	}
	return modeTx{tx, p.mode}, nil
}

func (p modePool) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	return p.pool.Exec(ctx, sql, withMode(p.mode, args)...)
}

func (p modePool) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	return p.pool.Query(ctx, sql, withMode(p.mode, args)...)
}

// modeTx is a transaction of a modePool.
type modeTx struct {
	pgx.Tx
	mode any
}

func (t modeTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	return t.Tx.Exec(ctx, sql, withMode(t.mode, args)...)
}

func (t modeTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	return t.Tx.Query(ctx, sql, withMode(t.mode, args)...)
}
