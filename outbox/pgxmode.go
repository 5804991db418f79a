package outbox

import (
	"context"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// The outbox's own statements on a pgx pool (every statement of the relay,
// Pending, DeadLetters, Redrive, Replay and Migrate) are sent in
// sqldb.OwnMode, the Handle's: one round trip, no named statement, so they
// run behind a transaction pooler whatever the pool's exec mode. Not the
// producer's insert, which runs in the producer's transaction and mode,
// where a prepared statement costs the server a quarter of a parsed one
// (73k against 290k instructions). Each parameter of ours is compared
// with or assigned to a column, added to a bigint, or a LIMIT, so the
// server types it in QueryExecModeExec.

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
	return p.pool.Exec(ctx, sql, sqldb.WithMode(p.mode, args)...)
}

func (p modePool) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	return p.pool.Query(ctx, sql, sqldb.WithMode(p.mode, args)...)
}

// modeTx is a transaction of a modePool.
type modeTx struct {
	pgx.Tx
	mode any
}

func (t modeTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	return t.Tx.Exec(ctx, sql, sqldb.WithMode(t.mode, args)...)
}

func (t modeTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	return t.Tx.Query(ctx, sql, sqldb.WithMode(t.mode, args)...)
}
