package main

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// TestPartitionedTableRowsOfNonV7IDsAreSeen: on the partitioned layout a
// non-UUIDv7 id's row lives in <table>_other; "processed show" finds it
// (exit 0, not "applied: no"), and "purge --dry-run" counts the rows of
// <table>_other the purger deletes.
func TestPartitionedTableRowsOfNonV7IDsAreSeen(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, q, schema := schemaDB(t)
	store, err := processedstore.NewStore(processedstore.Config{Layout: processedstore.LayoutPartitioned, Horizon: 48 * time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx, q); err != nil {
		t.Fatal(err)
	}
	v4 := uuid.New()
	if _, err := db.ExecContext(ctx, `INSERT INTO processed_event_other (consumer, event_id, processed_at, event_at)
		VALUES ('stock', $1, now() - interval '3 days', now() - interval '3 days')`, v4); err != nil {
		t.Fatal(err)
	}
	v7 := uuid.Must(uuid.NewV7())
	if _, err := db.ExecContext(ctx, `INSERT INTO processed_event (consumer, event_id) VALUES ('stock', $1)`, v7); err != nil {
		t.Fatal(err)
	}
	r := idem(t, schema, "processed", "show", v4.String(), "--json")
	wantCode(t, r, exitOK)
	if s := decode[processedShow](t, r); !s.Applied || len(s.Records) != 1 || s.Records[0].Consumer != "stock" {
		t.Fatalf("processed show of a v4 id on the partitioned layout: %+v", s)
	}
	wantCode(t, idem(t, schema, "processed", "show", v7.String()), exitOK)

	r = idem(t, schema, "purge", "--dry-run", "--horizon", "48h", "--json")
	wantCode(t, r, exitOK)
	if p := decode[purgePreview](t, r); p.Rows != 2 || p.ToDelete != 1 {
		t.Fatalf("preview: %+v, want 2 rows, 1 to delete (the v4 row of processed_event_other)", p)
	}
	purger, err := processedstore.NewPurger(store, sqldb.StdPool(db), processedstore.PurgerConfig{Horizon: 48 * time.Hour}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if n, ran, err := purger.PurgeNow(ctx); err != nil || !ran || n != 1 {
		t.Fatalf("purge: %d %v %v, want the 1 row the preview announced", n, ran, err)
	}
}

// TestPartitionMigrationLegacyRowsAreSeen: during the upgrade to the
// partitioned layout (MigrateToPartitioned, not finished) the rows claimed
// before it stay in <table>_legacy, where the claim still finds them (a
// redelivery is a duplicate): "processed show" reports such an event
// applied, and "purge --dry-run" counts the legacy rows the purger deletes.
func TestPartitionMigrationLegacyRowsAreSeen(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, q, schema := schemaDB(t)
	plain, err := processedstore.NewStore(processedstore.Config{Horizon: 48 * time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if err := plain.Migrate(ctx, q); err != nil {
		t.Fatal(err)
	}
	recent := uuid.Must(uuid.NewV7())
	if _, err := db.ExecContext(ctx, `INSERT INTO processed_event (consumer, event_id) VALUES ('stock', $1)`, recent); err != nil {
		t.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, `INSERT INTO processed_event (consumer, event_id, event_at)
		VALUES ('stock', gen_random_uuid(), now() - interval '3 days')`); err != nil {
		t.Fatal(err)
	}
	store, err := processedstore.NewStore(processedstore.Config{Layout: processedstore.LayoutPartitioned, Horizon: 48 * time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.MigrateToPartitioned(ctx, q); err != nil {
		t.Fatal(err)
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	ok, err := store.Claim(ctx, sqldb.Std(tx), "stock", recent)
	_ = tx.Rollback()
	if err != nil || ok {
		t.Fatalf("the claim of an event processed before the upgrade: %v %v, want a duplicate", ok, err)
	}

	r := idem(t, schema, "processed", "show", recent.String(), "--json")
	wantCode(t, r, exitOK)
	if s := decode[processedShow](t, r); !s.Applied || len(s.Records) != 1 || s.Records[0].Consumer != "stock" {
		t.Fatalf("processed show of an event processed before the upgrade: %+v", s)
	}
	r = idem(t, schema, "purge", "--dry-run", "--horizon", "48h", "--json")
	wantCode(t, r, exitOK)
	if p := decode[purgePreview](t, r); p.Rows != 2 || p.ToDelete != 1 {
		t.Fatalf("preview: %+v, want 2 rows, 1 to delete (the old row of processed_event_legacy)", p)
	}
	purger, err := processedstore.NewPurger(store, sqldb.StdPool(db), processedstore.PurgerConfig{Horizon: 48 * time.Hour}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if n, ran, err := purger.PurgeNow(ctx); err != nil || !ran || n != 1 {
		t.Fatalf("purge: %d %v %v, want the 1 row the preview announced", n, ran, err)
	}
}
