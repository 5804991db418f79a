package main

import (
	"context"
	"testing"
	"time"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// TestPurgeDryRun: the count and cutoff agree with what the purger then
// deletes, and the dry run deletes nothing.
func TestPurgeDryRun(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, q, schema := schemaDB(t)
	store, err := processedstore.NewStore(processedstore.Config{Horizon: 48 * time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx, q); err != nil {
		t.Fatal(err)
	}
	// 7 rows 3 days old, 5 rows 1 hour old, 4 new (database clock).
	for i, age := range []string{"3 days", "3 days", "3 days", "3 days", "3 days", "3 days", "3 days",
		"1 hour", "1 hour", "1 hour", "1 hour", "1 hour", "0", "0", "0", "0"} {
		if _, err := db.ExecContext(ctx, `INSERT INTO processed_event (consumer, event_id, processed_at, event_at)
			VALUES ('stock', gen_random_uuid(), now() - $1::interval, now() - $1::interval)`, age); err != nil {
			t.Fatal(i, err)
		}
	}
	r := idem(t, schema, "purge", "--dry-run", "--horizon", "48h", "--batch-size", "3", "--json")
	wantCode(t, r, exitOK)
	p := decode[purgePreview](t, r)
	if p.Rows != 16 || p.ToDelete != 7 || p.Batches != 3 || p.Horizon != "48h0m0s" {
		t.Fatalf("preview: %+v", p)
	}
	// The purger keeps rows 5 minutes past the horizon (a claim that
	// judged its window before a purge never claims a row it deleted).
	if d := time.Time(p.DatabaseAt).Sub(time.Time(p.Cutoff)); d != 48*time.Hour+5*time.Minute {
		t.Fatalf("cutoff is %s before the database clock, want 48h5m", d)
	}
	wantCode(t, idem(t, schema, "purge", "--dry-run", "--horizon", "30m", "--min-horizon", "1m"), exitOK)
	r = idem(t, schema, "purge", "--dry-run", "--horizon", "30m", "--min-horizon", "1m", "--json")
	if p := decode[purgePreview](t, r); p.ToDelete != 12 {
		t.Fatalf("30m: %+v", p)
	}
	// The dry run deleted nothing; the purger deletes what it announced.
	purger, err := processedstore.NewPurger(store, sqldb.StdPool(db), processedstore.PurgerConfig{Horizon: 48 * time.Hour}, nil)
	if err != nil {
		t.Fatal(err)
	}
	n, ran, err := purger.PurgeNow(ctx)
	if err != nil || !ran || n != 7 {
		t.Fatalf("purge: %d %v %v", n, ran, err)
	}

	for _, args := range [][]string{
		{"purge", "--horizon", "48h"},               // not a dry run
		{"purge", "--dry-run"},                      // no horizon
		{"purge", "--dry-run", "--horizon", "soon"}, // malformed
		{"purge", "--dry-run", "--horizon", "1m"},   // below the minimum
	} {
		wantCode(t, idem(t, schema, args...), exitUsage)
	}
}
