package testenv

import (
	"context"
	"database/sql"
	"path/filepath"
	"regexp"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// Names of the contract-suite targets, in the order EachTarget runs them.
const (
	TargetPostgresPgx    = "postgres-pgx"    // PostgreSQL through pgx v5 (pgxpool)
	TargetPostgresStdlib = "postgres-stdlib" // PostgreSQL through database/sql (pgx stdlib)
	TargetMariaDB        = "mariadb"         // MySQL dialect, go-sql-driver/mysql, MariaDB on loopback
	TargetSQLite         = "sqlite"          // SQLite dialect, modernc.org/sqlite, a file in the test's temp dir
)

// TargetNames lists every target of the contract suites.
var TargetNames = []string{TargetPostgresPgx, TargetPostgresStdlib, TargetMariaDB, TargetSQLite}

// Target is one dialect and driver a contract suite runs against, on a
// database of its own (a PostgreSQL schema, a MariaDB database, an SQLite
// file). Handles are closed and the database dropped when the test ends.
type Target struct {
	// Name is one of TargetNames.
	Name string
	// Dialect is the SQL dialect of the target.
	Dialect sqldb.Dialect
	// Database names the target's database: the PostgreSQL schema, the
	// MariaDB database, or the SQLite file's path. OpenTarget reopens it.
	Database string
	// DB runs statements outside any transaction (autocommit).
	DB sqldb.Querier
	// Pool hands out dedicated connections (sqldb.PgxPool or sqldb.StdPool).
	Pool sqldb.Pool
	// Pgx is the pool of the postgres-pgx target; nil for the others.
	Pgx *pgxpool.Pool
	// Std is the *sql.DB of the database/sql targets; nil for postgres-pgx.
	Std *sql.DB
}

// Tx is an open transaction of a Target.
type Tx struct {
	sqldb.Querier
	Commit   func() error
	Rollback func() error
}

// EachTarget runs fn once per target, as parallel subtests named after the
// targets, each on a fresh database with at most 8 connections. A service
// that cannot be reached fails its subtest.
func EachTarget(t *testing.T, fn func(t *testing.T, tg Target)) {
	t.Helper()
	for _, name := range TargetNames {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			fn(t, NewTarget(t, name, 8))
		})
	}
}

// NewTarget creates a fresh database for the named target and opens it
// with at most maxConns connections.
func NewTarget(t testing.TB, name string, maxConns int) Target {
	t.Helper()
	var database string
	switch name {
	case TargetPostgresPgx, TargetPostgresStdlib:
		database = Schema(t)
	case TargetMariaDB:
		database = MySQLDatabase(t)
	case TargetSQLite:
		database = filepath.Join(t.TempDir(), "test.db")
	default:
		t.Fatalf("testenv: unknown target %q", name)
	}
	return OpenTarget(t, name, database, maxConns)
}

// OpenTarget opens another handle, with at most maxConns connections, on the
// database of a target that exists (another instance, a child process).
func OpenTarget(t testing.TB, name, database string, maxConns int) Target {
	t.Helper()
	tg := Target{Name: name, Database: database}
	var driver, dsn string
	switch name {
	case TargetPostgresPgx:
		tg.Dialect = sqldb.PostgreSQL
		tg.Pgx = PoolOn(t, database, int32(maxConns))
		tg.DB, tg.Pool = sqldb.Pgx(tg.Pgx), sqldb.PgxPool(tg.Pgx)
		return tg
	case TargetPostgresStdlib:
		tg.Dialect, driver, dsn = sqldb.PostgreSQL, "pgx", SchemaURL(database)
	case TargetMariaDB:
		tg.Dialect, driver, dsn = sqldb.MySQL, "mysql", MySQLDatabaseDSN(database)
	case TargetSQLite:
		tg.Dialect, driver, dsn = sqldb.SQLite, "sqlite", SQLiteDSN(database)
	default:
		t.Fatalf("testenv: unknown target %q", name)
	}
	RequireDriver(t, driver)
	db, err := sql.Open(driver, dsn)
	if err != nil {
		t.Fatalf("testenv: %s: %v", name, err)
	}
	db.SetMaxOpenConns(maxConns)
	t.Cleanup(func() { _ = db.Close() })
	if err := db.Ping(); err != nil {
		t.Fatalf("testenv: %s (%s) unreachable: %v", name, database, err)
	}
	tg.Std, tg.DB, tg.Pool = db, sqldb.Std(db), sqldb.StdPool(db)
	return tg
}

// BeginTx opens a transaction; it reports errors instead of failing the
// test, so it may run in any goroutine. On SQLite (BEGIN IMMEDIATE, see
// SQLiteDSN) it waits for the other writers' transactions to end.
func (tg Target) BeginTx(ctx context.Context) (*Tx, error) {
	if tg.Pgx != nil {
		tx, err := tg.Pgx.Begin(ctx)
		if err != nil {
			return nil, err
		}
		return &Tx{
			Querier:  sqldb.Pgx(tx),
			Commit:   func() error { return tx.Commit(ctx) },
			Rollback: func() error { return tx.Rollback(ctx) },
		}, nil
	}
	tx, err := tg.Std.BeginTx(ctx, nil)
	if err != nil {
		return nil, err
	}
	return &Tx{Querier: sqldb.Std(tx), Commit: tx.Commit, Rollback: tx.Rollback}, nil
}

// Begin is BeginTx failing the test on error (test goroutine only). The
// transaction is rolled back when the test ends, if it is still open.
func (tg Target) Begin(t testing.TB) *Tx {
	t.Helper()
	tx, err := tg.BeginTx(context.Background())
	if err != nil {
		t.Fatalf("testenv: %s: begin: %v", tg.Name, err)
	}
	t.Cleanup(func() { _ = tx.Rollback() })
	return tx
}

// Exec runs query (rebound, see Rebind) outside any transaction, failing
// the test on error.
func (tg Target) Exec(t testing.TB, query string, args ...any) int64 {
	t.Helper()
	n, err := tg.DB.Exec(context.Background(), tg.Rebind(query), args...)
	if err != nil {
		t.Fatalf("testenv: %s: %s: %v", tg.Name, query, err)
	}
	return n
}

var dollarParam = regexp.MustCompile(`\$[0-9]+`)

// Rebind rewrites the $1, $2, … placeholders of a test's query into the
// target's: unchanged for PostgreSQL, ? for MySQL and SQLite. Each
// parameter must appear once, in order.
func (tg Target) Rebind(query string) string {
	if tg.Dialect == sqldb.PostgreSQL {
		return query
	}
	return dollarParam.ReplaceAllString(query, "?")
}

// Quote quotes a (validated, test-chosen) identifier for the target.
func (tg Target) Quote(name string) string {
	q := string(tg.Dialect.QuoteChar())
	return q + name + q
}

// MySQLDatabase creates a fresh MySQL/MariaDB database for the test,
// dropped when the test ends, and returns its name. It fails the test when
// the server is unreachable.
func MySQLDatabase(t testing.TB) string {
	t.Helper()
	RequireDriver(t, "mysql")
	admin, err := sql.Open("mysql", MySQLDSN())
	if err != nil {
		t.Fatalf("testenv: MySQL DSN %s: %v", MySQLDSN(), err)
	}
	defer admin.Close()
	name := UniqueName("t")
	if _, err := admin.Exec("CREATE DATABASE " + name); err != nil {
		t.Fatalf("testenv: MySQL/MariaDB at %s unreachable or refusing: %v (start it: start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd)", MySQLDSN(), err)
	}
	t.Cleanup(func() {
		admin, err := sql.Open("mysql", MySQLDSN())
		if err == nil {
			_, _ = admin.Exec("DROP DATABASE IF EXISTS " + name)
			_ = admin.Close()
		}
	})
	return name
}

// MySQLDatabaseDSN is the go-sql-driver/mysql DSN of database on the test
// server, with parseTime=true and loc=UTC (what the library requires).
func MySQLDatabaseDSN(database string) string {
	return MySQLDSN() + database + "?parseTime=true&loc=UTC"
}

// Handle is the target's database as the library's components take it.
func (tg Target) Handle() idempotency.DB {
	if tg.Pgx != nil {
		return idempotency.Pgx(tg.Pgx)
	}
	return idempotency.SQL(tg.Std, tg.Dialect)
}

// AsTx wraps a querier as the versioned tools take it.
func AsTx(q sqldb.Querier) idempotency.Tx { return sqldb.WrapTx(q).(idempotency.Tx) }
