package main

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
)

// An event a consumer of this release claimed through the pgx path is in
// processed_event_v7 (migration 0008) only. The operators' lookup must
// report it applied, and the purge preview must count its row.
func TestProcessedShowAndPurgePreviewSeeEventsClaimedInTheV7Table(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, q, schema := schemaDB(t)
	store, err := processedstore.NewStore(processedstore.Config{Table: schema + ".processed_event", Horizon: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx, q); err != nil {
		t.Fatal(err)
	}
	if err := store.CheckLean(ctx, q, "stock"); err != nil {
		t.Fatal(err)
	}
	id := uuid.Must(uuid.NewV7())
	p, ok := store.ClaimParamsAt("stock", id, time.Time{}, nil)
	if !ok || p.ConsumerID == 0 {
		t.Fatalf("not a claim in the v7 table: %+v", p)
	}
	if _, err := db.ExecContext(ctx, p.SQL, p.ConsumerID, id, p.EventAt); err != nil {
		t.Fatal(err)
	}
	var inV7, inTable int
	if err := db.QueryRowContext(ctx, `SELECT (SELECT count(*) FROM processed_event_v7), (SELECT count(*) FROM processed_event)`).Scan(&inV7, &inTable); err != nil {
		t.Fatal(err)
	}
	if inV7 != 1 || inTable != 0 {
		t.Fatalf("v7 table %d rows, table %d rows", inV7, inTable)
	}

	r := idem(t, schema, "processed", "show", id.String(), "--consumer", "stock", "--json")
	got := decode[processedShow](t, r)
	if !got.Applied || len(got.Records) != 1 {
		t.Errorf("processed show: event claimed in processed_event_v7 reported as %+v (exit %d)", got, r.code)
	}
	r = idem(t, schema, "purge", "--dry-run", "--horizon", "1h", "--json")
	prev := decode[purgePreview](t, r)
	if prev.Rows != 1 {
		t.Errorf("purge --dry-run: rows %d, want 1 (the row of processed_event_v7)", prev.Rows)
	}
}
