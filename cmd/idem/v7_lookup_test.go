package main

import (
	"bytes"
	"context"
	"database/sql"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// An event a consumer of this release claimed through the pgx path is in
// processed_event_v7 (migration 0008) only. The operators' lookup must
// report it applied, and the purge preview must count its row.
func TestProcessedShowAndPurgePreviewSeeEventsClaimedInTheV7Table(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, q, schema := schemaDB(t)
	id := uuid.Must(uuid.NewV7())
	claimInV7(t, db, q, schema, id)
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

// A UUIDv7 claim in processed_event_v7 keeps no time of its own. "processed
// show" must never present the event's own time (in its id) as the time it
// was applied: an event produced 30 minutes before it was applied would be
// reported applied on time. With track_commit_timestamp on (a private
// server) it shows the claim's commit time; with it off (the shared
// server's default) it says the time is not recorded.
func TestProcessedShowNeverGivesAUUIDv7ClaimItsEventTime(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	private := testenv.StartPostgres(t, "track_commit_timestamp=on")
	for _, tc := range []struct {
		name string
		// db returns a fresh schema and the URL that reaches it.
		db func(t *testing.T) (schema, url string)
		// commitTime: the server records commit times.
		commitTime bool
	}{
		{name: "track_commit_timestamp_off", db: func(t *testing.T) (string, string) {
			schema := testenv.Schema(t)
			return schema, testenv.SchemaURL(schema)
		}},
		{name: "track_commit_timestamp_on", commitTime: true, db: func(t *testing.T) (string, string) {
			schema := testenv.UniqueName("idem_v7time")
			db, err := sql.Open("pgx", private.URL)
			if err != nil {
				t.Fatal(err)
			}
			defer db.Close()
			if _, err := db.ExecContext(ctx, "CREATE SCHEMA "+schema); err != nil {
				t.Fatal(err)
			}
			u, err := url.Parse(private.URL)
			if err != nil {
				t.Fatal(err)
			}
			q := u.Query()
			q.Set("search_path", schema)
			u.RawQuery = q.Encode()
			return schema, u.String()
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			schema, dbURL := tc.db(t)
			db, err := sql.Open("pgx", dbURL)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				_, _ = db.ExecContext(context.Background(), "DROP SCHEMA IF EXISTS "+schema+" CASCADE")
				_ = db.Close()
			})
			produced := time.Now().Add(-30 * time.Minute)
			id := v7At(produced)
			var before, after time.Time
			if err := db.QueryRowContext(ctx, "SELECT clock_timestamp()").Scan(&before); err != nil {
				t.Fatal(err)
			}
			claimInV7(t, db, sqldb.Std(db), schema, id)
			if err := db.QueryRowContext(ctx, "SELECT clock_timestamp()").Scan(&after); err != nil {
				t.Fatal(err)
			}

			run := func(args ...string) result {
				var out, errb bytes.Buffer
				code := RunContext(ctx, append(args, "--database-url", dbURL), &out, &errb)
				t.Logf("idem %s → %d\n%s%s", strings.Join(args, " "), code, out.String(), errb.String())
				return result{code, out.String(), errb.String()}
			}
			r := run("processed", "show", id.String(), "--json")
			wantCode(t, r, exitOK)
			got := decode[processedShow](t, r)
			if !got.Applied || len(got.Records) != 1 {
				t.Fatalf("processed show: %+v", got)
			}
			at := got.Records[0].ProcessedAt
			switch {
			case !tc.commitTime && at != nil:
				t.Fatalf("processed_at %s for a claim that keeps no time (the event's time is %s)", time.Time(*at), produced)
			case tc.commitTime && at == nil:
				t.Fatal("processed_at null although the server records commit times")
			case tc.commitTime && (time.Time(*at).Before(before) || time.Time(*at).After(after)):
				t.Fatalf("processed_at %s, not the claim's commit time (between %s and %s)", time.Time(*at), before, after)
			}
			text := run("processed", "show", id.String())
			wantCode(t, text, exitOK)
			if !tc.commitTime && !strings.Contains(text.stdout, "not recorded") {
				t.Fatalf("the text output does not say the time is not recorded:\n%s", text.stdout)
			}
			if strings.Contains(strings.SplitN(text.stdout, "CONSUMER", 2)[1], ts(produced.Truncate(time.Millisecond))) {
				t.Fatalf("the record shows the event's own time:\n%s", text.stdout)
			}
		})
	}
}

// claimInV7 migrates schema's processed_event (2 h horizon) and claims id
// for consumer "stock" as a consumer of this release does: in
// processed_event_v7.
func claimInV7(t *testing.T, db *sql.DB, q sqldb.Querier, schema string, id uuid.UUID) {
	t.Helper()
	ctx := context.Background()
	store, err := processedstore.NewStore(processedstore.Config{Table: schema + ".processed_event", Horizon: 2 * time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx, q); err != nil {
		t.Fatal(err)
	}
	if err := store.CheckLean(ctx, q, "stock"); err != nil {
		t.Fatal(err)
	}
	p, ok := store.ClaimParamsAt("stock", id, time.Time{}, nil)
	if !ok || p.ConsumerID == 0 {
		t.Fatalf("not a claim in the v7 table: %+v", p)
	}
	if _, err := db.ExecContext(ctx, p.SQL, p.ConsumerID, id, p.EventAt); err != nil {
		t.Fatal(err)
	}
}
