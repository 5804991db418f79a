package main

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// result is one in-process run of the command.
type result struct {
	code           int
	stdout, stderr string
}

// idem runs the command in-process against the test's schema and broker.
func idem(t *testing.T, schema string, args ...string) result {
	t.Helper()
	full := append([]string{}, args...)
	full = append(full, "--database-url", testenv.SchemaURL(schema), "--amqp-url", testenv.AMQPURL())
	var out, errb bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	start := time.Now()
	code := RunContext(ctx, full, &out, &errb)
	t.Logf("idem %s → %d (%s)\n%s%s", strings.Join(args, " "), code, time.Since(start).Round(time.Millisecond), out.String(), errb.String())
	return result{code, out.String(), errb.String()}
}

// decode parses a --json output.
func decode[T any](t *testing.T, r result) T {
	t.Helper()
	var v T
	if err := json.Unmarshal([]byte(r.stdout), &v); err != nil {
		t.Fatalf("json output: %v\n%s", err, r.stdout)
	}
	return v
}

// schemaDB opens database/sql on a fresh schema.
func schemaDB(t *testing.T) (*sql.DB, sqldb.Querier, string) {
	t.Helper()
	schema := testenv.Schema(t)
	db, err := sql.Open("pgx", testenv.SchemaURL(schema))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	return db, sqldb.Std(db), schema
}

func wantCode(t *testing.T, r result, code int) {
	t.Helper()
	if r.code != code {
		t.Fatalf("exit %d, want %d\nstdout: %s\nstderr: %s", r.code, code, r.stdout, r.stderr)
	}
}

func TestUsage(t *testing.T) {
	wantCode(t, idem(t, "x"), exitUsage)
	wantCode(t, idem(t, "x", "nope"), exitUsage)
	r := idem(t, "x", "help")
	wantCode(t, r, exitOK)
	if !strings.Contains(r.stdout, "Exit codes") {
		t.Fatalf("help lacks the exit codes: %s", r.stdout)
	}
	r = idem(t, "x", "processed", "show", "a", "b")
	wantCode(t, r, exitUsage)
	if n := strings.Count(strings.TrimSpace(r.stderr), "\n"); n != 0 {
		t.Fatalf("error is %d lines, want one: %q", n+1, r.stderr)
	}
	wantCode(t, idem(t, "x", "processed", "show", "0190f0e2-1234-7abc-8def-0123456789ab", "--dialect", "oracle"), exitUsage)
}

func sqldbPgx(p *pgxpool.Pool) sqldb.Querier { return sqldb.Pgx(p) }

func TestUnknownFlagOneLine(t *testing.T) {
	r := idem(t, "x", "processed", "show", "0190f0e2-1234-7abc-8def-0123456789ab", "--bogus")
	wantCode(t, r, exitUsage)
	if n := strings.Count(strings.TrimSpace(r.stderr), "\n"); n != 0 {
		t.Fatalf("want one line, got %q", r.stderr)
	}
	r = idem(t, "x", "dlq", "redrive", "-h")
	wantCode(t, r, exitOK)
	if !strings.Contains(r.stderr, "-window") || !strings.Contains(r.stderr, "Exit codes") {
		t.Fatalf("-h: %q", r.stderr)
	}
}
