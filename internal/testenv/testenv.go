// Package testenv gives tests real services on loopback, isolated per test:
// a PostgreSQL schema of their own and unique AMQP names. A service that cannot
// be reached fails the test (never a skip), so a broken machine is never green.
package testenv

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib" // database/sql driver "pgx"
)

// DefaultPostgresURL is used when DATABASE_URL is unset.
const DefaultPostgresURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

// DefaultAMQPURL is used when AMQP_URL is unset.
const DefaultAMQPURL = "amqp://guest:guest@127.0.0.1:5672/"

// PostgresURL is DATABASE_URL or DefaultPostgresURL.
func PostgresURL() string {
	if u := os.Getenv("DATABASE_URL"); u != "" {
		return u
	}
	return DefaultPostgresURL
}

// AMQPURL is AMQP_URL or DefaultAMQPURL.
func AMQPURL() string {
	if u := os.Getenv("AMQP_URL"); u != "" {
		return u
	}
	return DefaultAMQPURL
}

// UniqueName returns prefix + "_" + 12 random hex characters, usable as a
// schema, table, exchange or queue name.
func UniqueName(prefix string) string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return strings.ToLower(prefix) + "_" + hex.EncodeToString(b[:])
}

// Schema creates a fresh PostgreSQL schema for the test and drops it (CASCADE)
// when the test ends. It fails the test when PostgreSQL is unreachable.
func Schema(t testing.TB) string {
	t.Helper()
	return SchemaOn(t, PostgresURL())
}

// SchemaOn is Schema on the server at url (a private one of StartPostgres).
func SchemaOn(t testing.TB, url string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	admin, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatalf("testenv: PostgreSQL config %s: %v", url, err)
	}
	defer admin.Close()
	schema := UniqueName("t")
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
		t.Fatalf("testenv: PostgreSQL at %s unreachable or refusing: %v (start it: pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start)", url, err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		admin, err := pgxpool.New(ctx, url)
		if err != nil {
			return
		}
		defer admin.Close()
		_, _ = admin.Exec(ctx, "DROP SCHEMA IF EXISTS "+schema+" CASCADE")
	})
	return schema
}

// PoolConfig returns a pgxpool config for url whose connections use schema as
// their search_path, with at most maxConns connections.
func PoolConfig(t testing.TB, url, schema string, maxConns int32) *pgxpool.Config {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatalf("testenv: parse %s: %v", url, err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	cfg.MaxConns = maxConns
	return cfg
}

// Pool returns a pool (at most 8 connections) on a fresh schema of its own,
// closed when the test ends, and the schema's name.
func Pool(t testing.TB) (*pgxpool.Pool, string) {
	t.Helper()
	schema := Schema(t)
	return PoolOn(t, schema, 8), schema
}

// PoolOn opens another pool on an existing schema (for "two services", "two
// instances" tests), closed when the test ends.
func PoolOn(t testing.TB, schema string, maxConns int32) *pgxpool.Pool {
	t.Helper()
	return PoolAt(t, PostgresURL(), schema, maxConns)
}

// PoolAt is PoolOn on the server at url (a private one of StartPostgres).
func PoolAt(t testing.TB, url, schema string, maxConns int32) *pgxpool.Pool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(ctx, PoolConfig(t, url, schema, maxConns))
	if err != nil {
		t.Fatalf("testenv: pool: %v", err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		t.Fatalf("testenv: PostgreSQL at %s unreachable: %v", url, err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// SchemaURL returns PostgresURL with search_path set to schema, for database/sql
// (pgx stdlib) connections.
func SchemaURL(schema string) string {
	u := PostgresURL()
	sep := "?"
	if strings.Contains(u, "?") {
		sep = "&"
	}
	return fmt.Sprintf("%s%ssearch_path=%s", u, sep, schema)
}

// DefaultMySQLDSN is used when MYSQL_DSN is unset (go-sql-driver/mysql form,
// without a database name).
const DefaultMySQLDSN = "root@tcp(127.0.0.1:3306)/"

// MySQLDSN is MYSQL_DSN or DefaultMySQLDSN.
func MySQLDSN() string {
	if u := os.Getenv("MYSQL_DSN"); u != "" {
		return u
	}
	return DefaultMySQLDSN
}

// MySQLDB creates a fresh MySQL/MariaDB database for the test (dropped at the
// end) and returns a *sql.DB on it (parseTime, UTC). It fails the test when
// the server is unreachable.
func MySQLDB(t testing.TB) *sql.DB {
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
	db, err := sql.Open("mysql", MySQLDSN()+name+"?parseTime=true&loc=UTC")
	if err != nil {
		t.Fatalf("testenv: %v", err)
	}
	db.SetMaxOpenConns(8)
	t.Cleanup(func() { _ = db.Close() })
	return db
}

// SQLiteDSN is the modernc.org/sqlite DSN the library recommends for a file:
// WAL (readers do not block the writer), busy_timeout 10 s (a second writer
// waits instead of failing with SQLITE_BUSY), BEGIN IMMEDIATE for
// transactions (the write lock is taken at BEGIN, so two transactions never
// deadlock upgrading a read lock), foreign keys on.
func SQLiteDSN(path string) string {
	return "file:" + path + "?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)&_pragma=foreign_keys(1)&_txlock=immediate"
}

// SQLiteDB opens a fresh SQLite database file in the test's temp dir.
func SQLiteDB(t testing.TB) *sql.DB {
	t.Helper()
	RequireDriver(t, "sqlite")
	db, err := sql.Open("sqlite", SQLiteDSN(filepath.Join(t.TempDir(), "test.db")))
	if err != nil {
		t.Fatalf("testenv: sqlite: %v", err)
	}
	t.Cleanup(func() { _ = db.Close() })
	if err := db.Ping(); err != nil {
		t.Fatalf("testenv: sqlite: %v", err)
	}
	return db
}

// DeliveryMetadata returns the keys an adapter sets on a delivery received
// (the redelivered flag, the delivery count, the crash bound's marks:
// wire.DeliveryScoped), as JetStream, Redis Streams and Kafka set them, for
// tests that check a message sent on goes without them.
func DeliveryMetadata() map[string]string {
	return map[string]string{
		"redelivered":                    "true",
		"delivery_count":                 "3",
		"idempotency_uncounted_delivery": "true",
		"idempotency_position":           "orders/3/41",
	}
}
