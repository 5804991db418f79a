package testenv_test

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// A private server with lc_messages=de_DE.UTF-8 answers in German (the
// locale compiled into its own directory, PostgreSQL's de catalogue), and
// the SQLSTATE stays the same: what the library classifies by.
func TestStartPostgres_lcMessages(t *testing.T) {
	t.Parallel()
	pg := testenv.StartPostgres(t, "lc_messages=de_DE.UTF-8")
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, pg.URL)
	if err != nil {
		t.Fatalf("connect %s: %v\n%s", pg.URL, err, pg.Log())
	}
	defer conn.Close(ctx)
	var lc string
	if err := conn.QueryRow(ctx, "SHOW lc_messages").Scan(&lc); err != nil {
		t.Fatal(err)
	}
	if lc != "de_DE.UTF-8" {
		t.Fatalf("lc_messages = %q, want de_DE.UTF-8", lc)
	}
	_, err = conn.Exec(ctx, "SELECT 1/0")
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		t.Fatalf("SELECT 1/0: want a *pgconn.PgError, got %v", err)
	}
	if pgErr.Code != "22012" || pgErr.Message != "Division durch Null" || pgErr.Severity != "FEHLER" {
		t.Fatalf("SELECT 1/0: want 22012 FEHLER \"Division durch Null\" (German), got %s %s %q", pgErr.Code, pgErr.Severity, pgErr.Message)
	}
}

// Settings reach the server; two private servers run side by side.
func TestStartPostgres_settings(t *testing.T) {
	t.Parallel()
	a := testenv.StartPostgres(t, "default_transaction_read_only=on")
	b := testenv.StartPostgres(t)
	if a.Port == b.Port {
		t.Fatalf("two servers on one port %d", a.Port)
	}
	ctx := context.Background()
	for _, tc := range []struct {
		pg   *testenv.Postgres
		want string
	}{{a, "on"}, {b, "off"}} {
		conn, err := pgx.Connect(ctx, tc.pg.URL)
		if err != nil {
			t.Fatalf("connect %s: %v", tc.pg.URL, err)
		}
		var got string
		err = conn.QueryRow(ctx, "SHOW default_transaction_read_only").Scan(&got)
		_ = conn.Close(ctx)
		if err != nil || got != tc.want {
			t.Fatalf("%s: default_transaction_read_only = %q (%v), want %q", tc.pg.URL, got, err, tc.want)
		}
	}
}
