package shop

import (
	"context"
	"database/sql"
	"errors"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/watermill-idempotency/idempotency/middleware"
)

// ErrNoRows is returned (wrapped, with the driver's own sentinel) by
// Row.Scan when a query returned no row, whichever driver ran it:
// errors.Is(err, ErrNoRows) holds, and so does errors.Is with pgx.ErrNoRows
// or sql.ErrNoRows.
var ErrNoRows = errors.New("shop: no rows in result set")

// Querier is the examples' dialect-neutral executor: what a service that
// runs on pgx (PostgreSQL) and on database/sql (SQLite) needs of a
// transaction or a pool. Placeholders stay the dialect's own ($1 on
// PostgreSQL, ? on SQLite): each service keeps its SQL text per dialect.
// PgxQuerier and StdQuerier adapt the native handles; TxFromContext finds
// the consumer attempt's transaction. It is a dozen lines of the examples,
// not of the library: copy it, or use pgx.Tx or *sql.Tx directly when your
// service has one driver (middleware.PgxTxFromContext, SQLTxFromContext).
type Querier interface {
	// Exec runs a statement and returns the number of rows it affected.
	Exec(ctx context.Context, query string, args ...any) (rowsAffected int64, err error)
	// QueryRow runs a query expected to return at most one row.
	QueryRow(ctx context.Context, query string, args ...any) Row
}

// Row is the single-row result of Querier.QueryRow.
type Row interface {
	// Scan copies the row's columns into dest; without a row its error
	// satisfies errors.Is(err, ErrNoRows).
	Scan(dest ...any) error
}

// PgxExecutor is what pgx.Tx, *pgx.Conn and *pgxpool.Pool have in common.
type PgxExecutor interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// StdExecutor is what *sql.Tx, *sql.DB and *sql.Conn have in common.
type StdExecutor interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// PgxQuerier adapts a pgx handle (a pgx.Tx, or a pool: autocommit).
func PgxQuerier(q PgxExecutor) Querier { return pgxQuerier{q} }

// StdQuerier adapts a database/sql handle (a *sql.Tx, or a *sql.DB:
// autocommit).
func StdQuerier(q StdExecutor) Querier { return stdQuerier{q} }

// TxFromContext returns the consumer attempt's transaction as a Querier,
// whichever the driver (middleware.PgxTxFromContext, then
// middleware.SQLTxFromContext). ok is false outside an attempt. Never
// commit or roll it back: the consumer ends it.
func TxFromContext(ctx context.Context) (q Querier, ok bool) {
	if tx, ok := middleware.PgxTxFromContext(ctx); ok {
		return PgxQuerier(tx), true
	}
	if tx, ok := middleware.SQLTxFromContext(ctx); ok {
		return StdQuerier(tx), true
	}
	return nil, false
}

type pgxQuerier struct{ q PgxExecutor }

func (p pgxQuerier) Exec(ctx context.Context, query string, args ...any) (int64, error) {
	tag, err := p.q.Exec(ctx, query, args...)
	if err != nil {
		return 0, err
	}
	return tag.RowsAffected(), nil
}

func (p pgxQuerier) QueryRow(ctx context.Context, query string, args ...any) Row {
	return pgxRow{p.q.QueryRow(ctx, query, args...)}
}

type pgxRow struct{ r pgx.Row }

func (r pgxRow) Scan(dest ...any) error {
	err := r.r.Scan(dest...)
	if errors.Is(err, pgx.ErrNoRows) {
		return errors.Join(ErrNoRows, err)
	}
	return err
}

type stdQuerier struct{ q StdExecutor }

func (s stdQuerier) Exec(ctx context.Context, query string, args ...any) (int64, error) {
	res, err := s.q.ExecContext(ctx, query, args...)
	if err != nil {
		return 0, err
	}
	return res.RowsAffected()
}

func (s stdQuerier) QueryRow(ctx context.Context, query string, args ...any) Row {
	return stdRow{s.q.QueryRowContext(ctx, query, args...)}
}

type stdRow struct{ r *sql.Row }

func (r stdRow) Scan(dest ...any) error {
	err := r.r.Scan(dest...)
	if errors.Is(err, sql.ErrNoRows) {
		return errors.Join(ErrNoRows, err)
	}
	return err
}
