package processedstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// On a table whose event_at is still NOT NULL DEFAULT now() (migration
// 0007 not run, or skipped for a table its owner partitioned), the lean
// claim would date a UUIDv7 row by the claim's now(), not by the id's
// time: an id dated ahead of the database clock (within MaxFutureSkew)
// would be purged while the claim still accepts its redelivery, and
// applied twice (found by review). CheckLean, which NewConsumer runs,
// turns the lean claim off there; after 0007 it stays on.
func TestLeanClaimOffWhereEventAtHasADefault(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := testenv.Pool(t)
	const h = time.Second
	store, err := processedstore.NewStore(processedstore.Config{Horizon: h, MaxFutureSkew: time.Hour})
	require.NoError(t, err)
	ms, err := store.Migrations()
	require.NoError(t, err)
	require.Len(t, ms, 9)
	// Migrations 1 to 6: a rolling deploy before 0007 runs.
	require.NoError(t, sqldb.Migrate(ctx, sqldb.Pgx(pool), sqldb.PostgreSQL, "processed:"+store.Table().String(), ms[:6]))
	require.NoError(t, store.CheckLean(ctx, sqldb.Pgx(pool), ""))

	var now time.Time
	require.NoError(t, pool.QueryRow(ctx, `SELECT now()`).Scan(&now))
	id := v7At(now.Add(30 * time.Minute)) // producer clock ahead, within the skew
	claim := func() int64 {
		p, ok := store.ClaimParamsAt("stock", id, time.Time{}, nil)
		require.True(t, ok)
		var args []any = []any{p.Consumer, p.EventID, nil}
		if p.HasEventAt {
			args[2] = p.EventAt
		}
		tag, err := pool.Exec(ctx, p.SQL, args...)
		require.NoError(t, err)
		return tag.RowsAffected()
	}
	require.Equal(t, int64(1), claim(), "first delivery claimed")

	// Wait (on the database clock, no timed assertion) until the horizon
	// has passed since the claim, but not since the event's own time.
	for {
		var past bool
		require.NoError(t, pool.QueryRow(ctx, `SELECT now() > $1::timestamptz + interval '1500 milliseconds'`, now).Scan(&past))
		if past {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	n, err := store.PurgeBatch(ctx, sqldb.Pgx(pool), h, 100)
	require.NoError(t, err)
	t.Logf("purged %d row(s)", n)
	require.Equal(t, int64(0), claim(), "redelivery of a claimed event (its time %s is within the horizon) must stay a duplicate after the purge", now.Add(30*time.Minute))
}

// After migration 0007 CheckLean keeps the lean claim: a UUIDv7 row is
// written without event_at (its id carries the time).
func TestLeanClaimOnAfterMigration7(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := testenv.Pool(t)
	store, err := processedstore.NewStore(processedstore.Config{Horizon: time.Hour})
	require.NoError(t, err)
	ms, err := store.Migrations()
	require.NoError(t, err)
	require.NoError(t, sqldb.Migrate(ctx, sqldb.Pgx(pool), sqldb.PostgreSQL, "processed:"+store.Table().String(), ms))
	require.NoError(t, store.CheckLean(ctx, sqldb.Pgx(pool), ""))
	p, ok := store.ClaimParamsAt("stock", v7At(time.Now()), time.Time{}, nil)
	require.True(t, ok)
	require.NotContains(t, p.SQL, "event_at)", "lean: no event_at column for a UUIDv7 id")
}
