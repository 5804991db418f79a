package shop

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/outbox"
)

// DB is the database of one example service: a pgx pool on PostgreSQL, or a
// database/sql handle with its dialect (SQLite in the embedded demo, through
// modernc.org/sqlite with WAL, a busy timeout and _txlock=immediate). It is
// the examples' small driver seam: each service writes its SQL once per
// dialect and runs it through DB and Tx.
type DB struct {
	// Pool is the PostgreSQL pool. Exactly one of Pool and SQL is set.
	Pool *pgxpool.Pool
	// SQL is the database/sql handle, of dialect Dialect.
	SQL *sql.DB
	// Dialect is idempotency.PostgreSQL with Pool; with SQL,
	// idempotency.SQLite (the examples carry no MySQL text).
	Dialect idempotency.Dialect
}

// PgxDB is the DB of a pgx pool (PostgreSQL).
func PgxDB(pool *pgxpool.Pool) DB { return DB{Pool: pool} }

// SQLiteDB is the DB of a database/sql handle on SQLite.
func SQLiteDB(db *sql.DB) DB { return DB{SQL: db, Dialect: idempotency.SQLite} }

// Validate reports whether exactly one handle is set, with a dialect the
// examples support.
func (d DB) Validate() error {
	switch {
	case d.Pool == nil && d.SQL == nil:
		return errors.New("no database (Pool or DB)")
	case d.Pool != nil && d.SQL != nil:
		return errors.New("Pool and DB: set one, not both")
	case d.Pool != nil && d.Dialect != idempotency.PostgreSQL:
		return fmt.Errorf("a pgx pool is PostgreSQL, not %s", d.Dialect)
	case d.SQL != nil && d.Dialect != idempotency.SQLite:
		return fmt.Errorf("dialect %s: the examples run database/sql on SQLite only", d.Dialect)
	}
	return nil
}

// IsSQLite reports whether d is a SQLite database.
func (d DB) IsSQLite() bool { return d.Dialect == idempotency.SQLite }

// Querier is d's pool as a Querier (statements outside a transaction).
func (d DB) Querier() Querier {
	if d.Pool != nil {
		return PgxQuerier(d.Pool)
	}
	return StdQuerier(d.SQL)
}

// Exec runs one statement, or a script of several without arguments, outside
// a transaction.
func (d DB) Exec(ctx context.Context, query string, args ...any) error {
	var err error
	if d.Pool != nil {
		_, err = d.Pool.Exec(ctx, query, args...)
	} else {
		_, err = d.SQL.ExecContext(ctx, query, args...)
	}
	return err
}

// Query runs query and calls each for every row with its Scan.
func (d DB) Query(ctx context.Context, query string, args []any, each func(scan func(dest ...any) error) error) error {
	if d.Pool != nil {
		rows, err := d.Pool.Query(ctx, query, args...)
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			if err := each(rows.Scan); err != nil {
				return err
			}
		}
		return rows.Err()
	}
	rows, err := d.SQL.QueryContext(ctx, query, args...)
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		if err := each(rows.Scan); err != nil {
			return err
		}
	}
	return rows.Err()
}

// Beginner is d as watermill-sql's Beginner (outbox relays, schema setup).
func (d DB) Beginner() wsql.Beginner {
	if d.Pool != nil {
		return wsql.BeginnerFromPgx(d.Pool)
	}
	return wsql.BeginnerFromStdSQL(d.SQL)
}

// Outbox is the library outbox (outbox.New) of table in d, in d's dialect.
func (d DB) Outbox(table string, logger watermill.LoggerAdapter) (*outbox.Outbox, error) {
	return outbox.New(outbox.Config{Table: table, DB: d.Handle()}, logger)
}

// Handle is d as the library's components take it (the one handle of
// middleware.NewConsumer, outbox.New, processed.Migrate, …).
func (d DB) Handle() idempotency.DB {
	if d.Pool != nil {
		return idempotency.Pgx(d.Pool)
	}
	return idempotency.SQL(d.SQL, d.Dialect)
}

// Tx is one transaction of a DB, in the forms the examples need.
type Tx struct {
	// Querier runs statements in the transaction.
	Querier Querier
	// Tx is the transaction as the versioned tools take it
	// (versioned.LatestPublisherConfig.Tx, Upsert.Apply).
	Tx idempotency.Tx
	// Outbox is the transaction for a watermill-sql publisher (an outbox
	// write); never commit or roll it back.
	Outbox wsql.ContextExecutor
	// Pgx is the pgx transaction on PostgreSQL, nil on SQLite.
	Pgx pgx.Tx
}

// InTx runs fn in a transaction of d: committed when fn returns nil, rolled
// back otherwise.
func (d DB) InTx(ctx context.Context, fn func(Tx) error) error {
	if d.Pool != nil {
		return pgx.BeginFunc(ctx, d.Pool, func(tx pgx.Tx) error {
			return fn(Tx{Querier: PgxQuerier(tx), Tx: idempotency.PgxTx(tx), Outbox: wsql.TxFromPgx(tx), Pgx: tx})
		})
	}
	tx, err := d.SQL.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	if err := fn(Tx{Querier: StdQuerier(tx), Tx: idempotency.SQLTx(tx), Outbox: wsql.TxFromStdSQL(tx)}); err != nil {
		_ = tx.Rollback()
		return err
	}
	return tx.Commit()
}

// OutboxPending counts the pending rows of ob in db (committed, not yet
// relayed). Rows of transactions still open are not visible and not counted.
func OutboxPending(ctx context.Context, db DB, ob *outbox.Outbox) (int, error) {
	return ob.Pending(ctx)
}

// SQLiteDSN is the modernc.org/sqlite DSN the examples use for a database
// file (the library's recommendation): WAL, so readers do not block the
// writer; busy_timeout 10 s, so a second writer waits instead of failing with
// SQLITE_BUSY; _txlock=immediate, so every transaction takes the write lock
// at BEGIN (no deadlock upgrading a read lock, and outbox offsets in commit
// order); foreign keys on.
func SQLiteDSN(path string) string {
	return "file:" + path + "?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)&_pragma=foreign_keys(1)&_txlock=immediate"
}
