package main

import (
	"context"
	"database/sql"
	"strings"
	"testing"
	"time"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/processed"
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
		{"purge", "--dry-run", "--horizon", "soon"}, // malformed
		{"purge", "--dry-run", "--horizon", "1m"},   // below the minimum
	} {
		wantCode(t, idem(t, schema, args...), exitUsage)
	}
}

// TestPurgeDryRunByTheTableHorizon: processed.Purger purges by the horizon
// the table keeps (the longer one for HorizonChangeGrace after a
// shortening; nothing on a table that keeps none), so the preview without
// --horizon counts by that horizon, exactly what the purger then deletes,
// and says when the purger deletes nothing; with --horizon it counts by
// that one and still names the table's.
func TestPurgeDryRunByTheTableHorizon(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	setup := func(t *testing.T) (*sql.DB, string, idempotency.DB) {
		db, _, schema := schemaDB(t)
		h := idempotency.SQL(db, idempotency.PostgreSQL)
		if err := processed.Migrate(ctx, h, processed.Config{}); err != nil {
			t.Fatal(err)
		}
		// 7 rows 3 days old, 5 rows 30 hours old, 4 new (database clock).
		for i, age := range []string{"3 days", "3 days", "3 days", "3 days", "3 days", "3 days", "3 days",
			"30 hours", "30 hours", "30 hours", "30 hours", "30 hours", "0", "0", "0", "0"} {
			if _, err := db.ExecContext(ctx, `INSERT INTO processed_event (consumer, event_id, processed_at, event_at)
				VALUES ('stock', gen_random_uuid(), now() - $1::interval, now() - $1::interval)`, age); err != nil {
				t.Fatal(i, err)
			}
		}
		return db, schema, h
	}
	purge := func(t *testing.T, h idempotency.DB) (int64, bool) {
		p, err := processed.NewPurger(processed.PurgerConfig{DB: h}, nil)
		if err != nil {
			t.Fatal(err)
		}
		n, ran, err := p.PurgeNow(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return n, ran
	}

	t.Run("kept", func(t *testing.T) {
		t.Parallel()
		_, schema, h := setup(t)
		if err := processed.SetReplayHorizon(ctx, h, "", 48*time.Hour); err != nil { // a fresh table: in force at once
			t.Fatal(err)
		}
		if err := processed.SetReplayHorizon(ctx, h, "", 24*time.Hour); err != nil { // shortened: 48 h for the grace
			t.Fatal(err)
		}
		r := idem(t, schema, "purge", "--dry-run", "--json")
		wantCode(t, r, exitOK)
		p := decode[purgePreview](t, r)
		if !p.Purges || p.Horizon != "48h0m0s" || p.TableHorizon != "24h0m0s" || p.Rows != 16 || p.ToDelete != 7 {
			t.Fatalf("preview: %+v, want 7 rows by the 48 h the purger keeps for the grace", p)
		}
		r = idem(t, schema, "purge", "--dry-run", "--horizon", "24h", "--json")
		wantCode(t, r, exitOK)
		if p := decode[purgePreview](t, r); p.ToDelete != 12 || p.TableHorizon != "24h0m0s" {
			t.Fatalf("preview --horizon 24h: %+v", p)
		}
		if n, ran := purge(t, h); !ran || n != 7 {
			t.Fatalf("purge: %d %v, want the 7 rows the preview announced", n, ran)
		}
	})
	t.Run("none", func(t *testing.T) {
		t.Parallel()
		_, schema, h := setup(t)
		r := idem(t, schema, "purge", "--dry-run", "--json")
		wantCode(t, r, exitOK)
		if p := decode[purgePreview](t, r); p.Purges || p.Rows != 16 || p.ToDelete != 0 || p.Batches != 0 {
			t.Fatalf("preview: %+v, want nothing deleted: the table keeps no horizon", p)
		}
		r = idem(t, schema, "purge", "--dry-run")
		wantCode(t, r, exitOK)
		if !strings.Contains(r.stdout, "keeps no replay horizon") {
			t.Fatalf("the preview does not say why nothing is deleted: %s", r.stdout)
		}
		if n, ran := purge(t, h); ran || n != 0 {
			t.Fatalf("purge: %d %v, want nothing", n, ran)
		}
	})
}
