package idempotency

import (
	"context"
	"database/sql"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// DB is the one database handle every component takes: the consumer
// (middleware.NewConsumer), the outbox and its relay, the operation runner,
// the versioned tools, the purgers and the migrations. Build it once per
// database with Pgx or SQL and pass the same value everywhere. The zero DB
// is refused by every constructor ("no database handle").
type DB struct{ h *sqldb.Handle }

// Dialect names the SQL dialect of a DB.
type Dialect = sqldb.Dialect

// The supported dialects.
const (
	// PostgreSQL 13 or later (pgx v5, or database/sql with pgx's stdlib).
	PostgreSQL = sqldb.PostgreSQL
	// MySQL 8.0.16+ or MariaDB 10.11+ (database/sql with
	// go-sql-driver/mysql, DSN with parseTime=true).
	MySQL = sqldb.MySQL
	// SQLite 3.35+ (database/sql, e.g. modernc.org/sqlite).
	SQLite = sqldb.SQLite
)

// Pgx returns the handle of a pgx v5 pool (PostgreSQL). The library never
// closes the pool. A nil pool gives the zero DB.
func Pgx(pool *pgxpool.Pool) DB {
	if pool == nil {
		return DB{}
	}
	return DB{sqldb.PgxHandle(pool)}
}

// SQL returns the handle of a database/sql pool and its dialect. The
// library never closes db. A nil db gives the zero DB.
func SQL(db *sql.DB, dialect Dialect) DB {
	if db == nil {
		return DB{}
	}
	return DB{&sqldb.Handle{Dialect: dialect, Std: db}}
}

// Dialect returns the handle's SQL dialect (PostgreSQL for the zero DB).
func (d DB) Dialect() Dialect {
	if d.h == nil {
		return sqldb.PostgreSQL
	}
	return d.h.Dialect
}

func init() {
	sqldb.SetUnwrap(func(v any) *sqldb.Handle {
		if d, ok := v.(DB); ok {
			return d.h
		}
		return nil
	}, func(v any) sqldb.Querier {
		if t, ok := v.(Tx); ok {
			return t.q
		}
		return nil
	}, func(q sqldb.Querier) any { return Tx{q} })
}

// Tx is a transaction in the form the versioned tools take (Upsert.Apply,
// LatestPublisherConfig.Tx): build it with PgxTx or SQLTx, or take the
// consumer attempt's with middleware.TxFromContext. Statements run on it
// commit or roll back with it.
type Tx struct{ q sqldb.Querier }

// PgxExecutor is what pgx.Tx, *pgx.Conn and *pgxpool.Pool have in common.
type PgxExecutor interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// SQLExecutor is what *sql.Tx, *sql.DB and *sql.Conn have in common.
type SQLExecutor interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// PgxTx wraps a pgx transaction (a *pgxpool.Pool or *pgx.Conn also fits:
// each statement then runs in autocommit).
func PgxTx(tx PgxExecutor) Tx { return Tx{sqldb.Pgx(tx)} }

// SQLTx wraps a database/sql transaction (a *sql.DB or *sql.Conn also
// fits: each statement then runs in autocommit).
func SQLTx(tx SQLExecutor) Tx { return Tx{sqldb.Std(tx)} }
