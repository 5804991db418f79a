package testenv

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
)

// A transaction-mode pooler hands consecutive transactions of one client to
// different server connections (what the library's pooler tests rely on).
func TestStartPgBouncer_transactionModeSharesServerConnections(t *testing.T) {
	t.Parallel()
	b := StartPgBouncer(t, "transaction", "default_pool_size = 2")
	ctx := context.Background()
	a := b.PoolBehind(t, pgx.QueryExecModeSimpleProtocol, 1)
	c := b.PoolBehind(t, pgx.QueryExecModeSimpleProtocol, 1)
	var pid int
	if err := a.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		t.Fatal(err)
	}
	// The second client's session setting is seen by the first client: one
	// server connection serves both.
	tx, err := a.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	var other int
	if err := c.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&other); err != nil {
		t.Fatal(err)
	}
	var mine int
	if err := tx.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&mine); err != nil {
		t.Fatal(err)
	}
	if mine == other {
		t.Fatalf("an open transaction's server connection %d served another client", mine)
	}
}
