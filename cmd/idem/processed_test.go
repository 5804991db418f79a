package main

import (
	"context"
	"strings"
	"testing"

	"github.com/google/uuid"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
)

func TestProcessedShow(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, q, schema := schemaDB(t)
	store, err := processedstore.NewStore(processedstore.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx, q); err != nil {
		t.Fatal(err)
	}
	applied, other := uuid.Must(uuid.NewV7()), uuid.Must(uuid.NewV7())
	for _, c := range []string{"stock", "billing"} {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.ExecContext(ctx, `INSERT INTO processed_event (consumer, event_id) VALUES ($1, $2)`, c, applied); err != nil {
			_ = tx.Rollback()
			t.Fatal(err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
	}

	// Every RFC 9562 text form names the same event.
	s := applied.String()
	for _, form := range []string{s, strings.ToUpper(s), "{" + s + "}", strings.ReplaceAll(s, "-", ""), "urn:uuid:" + s} {
		r := idem(t, schema, "processed", "show", form, "--json")
		wantCode(t, r, exitOK)
		got := decode[processedShow](t, r)
		if got.EventID != s || !got.Applied || len(got.Records) != 2 {
			t.Fatalf("%s: got %+v", form, got)
		}
		if got.ProducedAt == nil {
			t.Fatalf("%s: no produced_at for a UUIDv7", form)
		}
	}

	// Filter by consumer; the table form names it.
	r := idem(t, schema, "processed", "show", s, "--consumer", "billing")
	wantCode(t, r, exitOK)
	if !strings.Contains(r.stdout, "billing") || strings.Contains(r.stdout, "stock") {
		t.Fatalf("table: %s", r.stdout)
	}
	// Not applied by that consumer, or at all: exit 2.
	wantCode(t, idem(t, schema, "processed", "show", s, "--consumer", "shipping"), exitNotFound)
	r = idem(t, schema, "processed", "show", other.String())
	wantCode(t, r, exitNotFound)
	if !strings.Contains(r.stdout, "applied:     no") && !strings.Contains(r.stdout, "no") {
		t.Fatalf("table: %s", r.stdout)
	}
	// Malformed and nil ids: exit 1, one line.
	for _, bad := range []string{"nope", "00000000-0000-0000-0000-000000000000", s + " "} {
		r := idem(t, schema, "processed", "show", bad)
		wantCode(t, r, exitUsage)
	}
	// A missing table is a failure naming it, not "not applied".
	r = idem(t, schema, "processed", "show", s, "--processed-table", "nope")
	wantCode(t, r, exitFailed)
	if !strings.Contains(r.stderr, "nope does not exist") {
		t.Fatalf("stderr: %s", r.stderr)
	}
}
