// Package sqldb is the driver seam shared by processed, versioned and operation:
// a two-method Querier that both pgx v5 (pgx.Tx, *pgxpool.Pool, *pgx.Conn) and
// database/sql (*sql.Tx, *sql.DB, *sql.Conn) satisfy through a thin adapter.
//
// The library writes each dialect's SQL once and runs it through a Querier, so
// users keep their native transaction type: a pgx user passes sqldb.Pgx(tx),
// a database/sql user passes sqldb.Std(tx). Errors are returned unchanged from
// the driver (a *pgconn.PgError stays a *pgconn.PgError, also through pgx's
// stdlib), except that "no rows" from either driver satisfies
// errors.Is(err, ErrNoRows).
package sqldb

import (
	"context"
	"database/sql"
	"errors"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// ErrNoRows is returned by Row.Scan when a query returned no row, whichever
// driver ran it. The driver's own sentinel (pgx.ErrNoRows, sql.ErrNoRows) is
// wrapped, so errors.Is works for it too.
var ErrNoRows = errors.New("sqldb: no rows in result set")

// Querier runs SQL on one transaction or connection. It is what the library's
// stores take; Pgx and Std build one from a native handle. Placeholders are the
// dialect's own ($1 for PostgreSQL, ? for MySQL and SQLite).
type Querier interface {
	// Exec runs a statement and returns the number of rows it affected.
	Exec(ctx context.Context, query string, args ...any) (rowsAffected int64, err error)
	// QueryRow runs a query expected to return at most one row.
	QueryRow(ctx context.Context, query string, args ...any) Row
}

// Row is the single-row result of Querier.QueryRow.
type Row interface {
	// Scan copies the row's columns into dest; it returns an error satisfying
	// errors.Is(err, ErrNoRows) when there was no row.
	Scan(dest ...any) error
}

// PgxQuerier is what pgx.Tx, *pgx.Conn, *pgxpool.Pool and *pgxpool.Conn have in common.
type PgxQuerier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// StdQuerier is what *sql.Tx, *sql.DB and *sql.Conn have in common.
type StdQuerier interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// Pgx adapts a pgx v5 handle (pgx.Tx, *pgx.Conn, *pgxpool.Pool, *pgxpool.Conn).
func Pgx(q PgxQuerier) Querier { return pgxQuerier{q} }

// Std adapts a database/sql handle (*sql.Tx, *sql.DB, *sql.Conn).
func Std(q StdQuerier) Querier { return stdQuerier{q} }

type pgxQuerier struct{ q PgxQuerier }

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

type stdQuerier struct{ q StdQuerier }

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
