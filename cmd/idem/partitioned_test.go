package main

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/processed"
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

// v7At is a UUIDv7 of time at (random bits after the timestamp).
func v7At(at time.Time) uuid.UUID {
	id := uuid.New()
	ms := uint64(at.UnixMilli())
	for i := 5; i >= 0; i-- {
		id[i] = byte(ms)
		ms >>= 8
	}
	id[6] = id[6]&0x0f | 0x70
	return id
}

// v7Bound is the smallest UUID of at's millisecond.
func v7Bound(at time.Time) uuid.UUID {
	var id uuid.UUID
	ms := uint64(at.UnixMilli())
	for i := 5; i >= 0; i-- {
		id[i] = byte(ms)
		ms >>= 8
	}
	return id
}

// TestPartitionedPreviewCountsWhatThePurgerRemoves: on the partitioned
// layout the purger drops a time partition only when its whole range is
// past the cutoff, and counts only the rows it DELETEs (default partition,
// <table>_other, <table>_legacy). The preview counts the same: an expired
// row in a partition that is not dropped is not "to delete", and the rows
// of the partitions it drops are shown apart, with their names.
func TestPartitionedPreviewCountsWhatThePurgerRemoves(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, _, schema := schemaDB(t)
	h := idempotency.SQL(db, idempotency.PostgreSQL)
	if err := processed.Migrate(ctx, h, processed.Config{Layout: processed.LayoutPartitioned}); err != nil {
		t.Fatal(err)
	}
	if err := processed.SetReplayHorizon(ctx, h, "", 2*time.Hour); err != nil {
		t.Fatal(err)
	}
	var now time.Time
	if err := db.QueryRowContext(ctx, `SELECT now()`).Scan(&now); err != nil {
		t.Fatal(err)
	}
	// A: [now − 3 h, now − 1 h), its first half past the cutoff (now − 2 h 5 min): kept whole.
	// B: [now − 6 h, now − 5 h): dropped.
	a, b := now.UTC().Truncate(time.Minute).Add(-3*time.Hour), now.UTC().Truncate(time.Minute).Add(-6*time.Hour)
	for _, p := range []struct {
		name     string
		from, to time.Time
	}{{"processed_event_a", a, a.Add(2 * time.Hour)}, {"processed_event_b", b, b.Add(time.Hour)}} {
		if _, err := db.ExecContext(ctx, fmt.Sprintf(`CREATE TABLE %s PARTITION OF processed_event FOR VALUES FROM ('%s') TO ('%s')`,
			p.name, v7Bound(p.from), v7Bound(p.to))); err != nil {
			t.Fatal(err)
		}
	}
	for _, at := range []time.Time{a.Add(30 * time.Minute), b.Add(10 * time.Minute), b.Add(20 * time.Minute)} {
		if _, err := db.ExecContext(ctx, `INSERT INTO processed_event (consumer, event_id, event_at) VALUES ('stock', $1, $2)`, v7At(at), at); err != nil {
			t.Fatal(err)
		}
	}

	r := idem(t, schema, "purge", "--dry-run", "--json")
	wantCode(t, r, exitOK)
	p := decode[purgePreview](t, r)
	if p.Rows != 3 || p.ToDelete != 0 || p.ToDrop != 2 || len(p.DropPartitions) != 1 || p.DropPartitions[0] != "processed_event_b" {
		t.Fatalf("preview: %+v, want 3 rows, none to delete, 2 in the partition processed_event_b to drop", p)
	}
	purger, err := processed.NewPurger(processed.PurgerConfig{DB: h, Layout: processed.LayoutPartitioned}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if n, ran, err := purger.PurgeNow(ctx); err != nil || !ran || n != 0 {
		t.Fatalf("purge: %d %v %v, want 0 rows deleted", n, ran, err)
	}
	var left int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM processed_event`).Scan(&left); err != nil || left != 1 {
		t.Fatalf("rows left: %d %v, want the 1 row of processed_event_a", left, err)
	}
}
