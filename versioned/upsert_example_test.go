package versioned_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/versioned"
)

// A shipping service keeps a copy of each customer's name. Events arrive out
// of order; the copy only moves forward. The handler receives the transaction
// that the idempotency middleware opened (here: pgx.BeginFunc), so the row and
// the processed-event record commit together.
func ExampleNewUpsert() {
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, testenv.PostgresURL())
	if err != nil {
		panic(err)
	}
	defer conn.Close(ctx)
	// A session-local table keeps the example self-contained; a service would
	// create customer_copy in a migration.
	if _, err := conn.Exec(ctx, `CREATE TEMP TABLE customer_copy (
		customer_id text PRIMARY KEY,
		version     bigint,
		name        text)`); err != nil {
		panic(err)
	}

	// Built once, at service start: validates and builds the SQL.
	upsert, err := versioned.NewUpsert(versioned.UpsertConfig{
		Table:         "customer_copy",
		KeyColumns:    []string{"customer_id"},
		VersionColumn: "version",
		ValueColumns:  []string{"name"},
	})
	if err != nil {
		panic(err)
	}

	type customerRenamed struct {
		CustomerID string `json:"customer_id"`
		Version    *int64 `json:"version"` // nil when missing or null
		Name       string `json:"name"`
	}
	handle := func(ctx context.Context, tx pgx.Tx, payload []byte) error {
		var ev customerRenamed
		if err := json.Unmarshal(payload, &ev); err != nil {
			return err
		}
		outcome, err := upsert.Apply(ctx, idempotency.PgxTx(tx), []any{ev.CustomerID}, ev.Version, []any{ev.Name})
		if err != nil {
			return err // ErrVersionMissing is permanent: poison topic, no retry
		}
		// Side effects that must follow only the newest state belong under
		// outcome.Applied(); a Stale event is acked like an applied one.
		fmt.Printf("%s v%d %q: %s\n", ev.CustomerID, *ev.Version, ev.Name, outcome)
		return nil
	}

	for _, payload := range []string{
		`{"customer_id":"c-1","version":3,"name":"Carol"}`,
		`{"customer_id":"c-1","version":1,"name":"Alice"}`,
		`{"customer_id":"c-1","version":4,"name":"Dora"}`,
		`{"customer_id":"c-1","version":4,"name":"Zed"}`,
		`{"customer_id":"c-1","name":"No version"}`,
	} {
		err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			return handle(ctx, tx, []byte(payload))
		})
		var p interface{ Permanent() bool }
		if errors.As(err, &p) && p.Permanent() {
			fmt.Println("permanent:", errors.Is(err, versioned.ErrVersionMissing))
		}
	}

	var version int64
	var name string
	if err := conn.QueryRow(ctx, "SELECT version, name FROM customer_copy WHERE customer_id = 'c-1'").Scan(&version, &name); err != nil {
		panic(err)
	}
	fmt.Println("stored:", version, name)
	// Output:
	// c-1 v3 "Carol": inserted
	// c-1 v1 "Alice": stale
	// c-1 v4 "Dora": updated
	// c-1 v4 "Zed": stale
	// permanent: true
	// stored: 4 Dora
}
