// Package testenv gives tests real services on loopback, isolated per test:
// a PostgreSQL schema of their own and unique AMQP names. A service that cannot
// be reached fails the test (never a skip), so a broken machine is never green.
package testenv

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
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
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	admin, err := pgxpool.New(ctx, PostgresURL())
	if err != nil {
		t.Fatalf("testenv: PostgreSQL config %s: %v", PostgresURL(), err)
	}
	defer admin.Close()
	schema := UniqueName("t")
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
		t.Fatalf("testenv: PostgreSQL at %s unreachable or refusing: %v (start it: pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start)", PostgresURL(), err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		admin, err := pgxpool.New(ctx, PostgresURL())
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
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(ctx, PoolConfig(t, PostgresURL(), schema, maxConns))
	if err != nil {
		t.Fatalf("testenv: pool: %v", err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		t.Fatalf("testenv: PostgreSQL at %s unreachable: %v", PostgresURL(), err)
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
