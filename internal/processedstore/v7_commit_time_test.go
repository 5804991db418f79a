package processedstore_test

import (
	"context"
	"database/sql"
	"net/url"
	"testing"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// A row of <table>_v7 is shown with the commit time of the transaction
// that wrote it. For a UUIDv7 event claimed before migration 0008 (in the
// table, with its processed_at), that transaction is Migrate's copy, not
// the claim: once the table's row is purged by its event_at (older than
// the event's id time) and only the copy is left, the lookup must not
// report the event processed at the upgrade (not recorded instead). A
// claim made after the upgrade, in <table>_v7, shows its commit time.
func TestV7RowCopiedByTheMigrationIsNotShownAtTheMigrationsTime(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	private := testenv.StartPostgres(t, "track_commit_timestamp=on")
	schema := testenv.UniqueName("v7_commit_time")
	admin, err := sql.Open("pgx", private.URL)
	require.NoError(t, err)
	defer admin.Close()
	_, err = admin.ExecContext(ctx, "CREATE SCHEMA "+schema)
	require.NoError(t, err)
	u, err := url.Parse(private.URL)
	require.NoError(t, err)
	qs := u.Query()
	qs.Set("search_path", schema)
	u.RawQuery = qs.Encode()
	db, err := sql.Open("pgx", u.String())
	require.NoError(t, err)
	defer db.Close()
	q := sqldb.Std(db)

	// The previous release: migrations 1-7, a UUIDv7 event produced 30
	// min ago (its id), dated 2 h ago by its occurred_at, processed 25 min ago.
	s := previousRelease(t, q, schema+".processed_event")
	id := v7At(time.Now().Add(-30 * time.Minute))
	processedAt := time.Now().Add(-25 * time.Minute).UTC().Truncate(time.Microsecond)
	_, err = db.ExecContext(ctx, `INSERT INTO processed_event (consumer, event_id, processed_at, event_at) VALUES ('stock', $1, $2, $3)`,
		id.String(), processedAt, time.Now().Add(-2*time.Hour))
	require.NoError(t, err)

	upgrade := time.Now()
	require.NoError(t, s.Migrate(ctx, q)) // 0008, then the copy into processed_event_v7
	var inV7 int
	require.NoError(t, db.QueryRowContext(ctx, `SELECT count(*) FROM processed_event_v7`).Scan(&inV7))
	require.Equal(t, 1, inV7, "copied by the migration")

	// The purge by event_at takes the table's row; the copy, dated by its id, stays.
	_, err = s.PurgeBatch(ctx, q, time.Hour, 100)
	require.NoError(t, err)
	var inTable int
	require.NoError(t, db.QueryRowContext(ctx, `SELECT (SELECT count(*) FROM processed_event), (SELECT count(*) FROM processed_event_v7)`).Scan(&inTable, &inV7))
	require.Equal(t, 0, inTable, "the table's row purged")
	require.Equal(t, 1, inV7, "the copy kept")

	require.NoError(t, s.ReadLegacy(ctx, q))
	lq, args := s.LookupQuery(id, "")
	var consumer string
	var at *time.Time
	require.NoError(t, db.QueryRowContext(ctx, lq, args...).Scan(&consumer, &at))
	require.Equal(t, "stock", consumer)
	if at != nil {
		require.False(t, !at.Before(upgrade), "processed_at %s is the migration's copy (at or after the upgrade %s), "+
			"not the claim (processed at %s)", at.UTC(), upgrade.UTC(), processedAt)
	}

	// A claim of this release, in processed_event_v7: its commit time.
	require.NoError(t, s.CheckLean(ctx, q, "stock"))
	fresh := v7At(time.Now())
	p, ok := s.ClaimParamsAt("stock", fresh, time.Time{}, nil)
	require.True(t, ok)
	require.NotZero(t, p.ConsumerID, "a claim in the v7 table")
	var before, after time.Time
	require.NoError(t, db.QueryRowContext(ctx, "SELECT clock_timestamp()").Scan(&before))
	_, err = db.ExecContext(ctx, p.SQL, p.ConsumerID, fresh, p.EventAt)
	require.NoError(t, err)
	require.NoError(t, db.QueryRowContext(ctx, "SELECT clock_timestamp()").Scan(&after))
	lq, args = s.LookupQuery(fresh, "")
	require.NoError(t, db.QueryRowContext(ctx, lq, args...).Scan(&consumer, &at))
	require.NotNil(t, at, "a claim in the v7 table after the upgrade shows its commit time")
	require.True(t, !at.Before(before) && !at.After(after), "processed_at %s, the claim committed between %s and %s", at, before, after)
}
