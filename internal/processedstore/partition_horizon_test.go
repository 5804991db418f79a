package processedstore_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// The purger of a partitioned table keeps creating the spans ahead while
// it purges nothing: on a table that keeps no horizon (its consumers at 0)
// and within HorizonChangeGrace of one recorded over none. Without it,
// after the spans Migrate made, every claim of those hours lands in the
// default partition (DELETE-purged), and their spans wait until its rows
// expire.
func TestPartitionsAreCreatedAheadWhileNothingIsPurged(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	s := partitionedStore(t, time.Hour, 0)
	require.NoError(t, s.Migrate(ctx, sqldb.Pgx(pool)))
	p, err := processedstore.NewPurger(s, sqldb.PgxPool(pool), processedstore.PurgerConfig{FromTable: true}, nil)
	require.NoError(t, err)
	// As if the purger had not run for two spans: the span after next has
	// no partition.
	dropAhead := func() time.Time {
		now := dbNow(t, pool)
		ahead := now.UTC().Truncate(time.Hour).Add(2 * time.Hour)
		_, err := pool.Exec(ctx, `DROP TABLE processed_event_p`+ahead.Format("200601021504"))
		require.NoError(t, err)
		return now
	}

	_, _, err = s.AdoptHorizon(ctx, sqldb.Pgx(pool), 0, time.Now())
	require.NoError(t, err)
	now := dropAhead()
	_, _, err = p.PurgeNow(ctx)
	require.NoError(t, err)
	requireCovered(t, coverage(t, pool, "processed_event"), now, now.Add(3*time.Hour))

	_, _, err = s.AdoptHorizon(ctx, sqldb.Pgx(pool), 2*time.Hour, time.Now())
	require.NoError(t, err)
	now = dropAhead()
	_, _, err = p.PurgeNow(ctx)
	require.NoError(t, err)
	requireCovered(t, coverage(t, pool, "processed_event"), now, now.Add(3*time.Hour))
}

// A purger that purges nothing (the table keeps no horizon, or one
// recorded over none within HorizonChangeGrace) drops no partition either:
// its consumers refuse nothing, so a redelivery of an event of any age
// must find its row.
func TestPartitionsAreNotDroppedWhileNothingIsPurged(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	s := partitionedStore(t, time.Hour, 0)
	require.NoError(t, s.Migrate(ctx, sqldb.Pgx(pool)))
	p, err := processedstore.NewPurger(s, sqldb.PgxPool(pool), processedstore.PurgerConfig{FromTable: true}, nil)
	require.NoError(t, err)
	_, _, err = s.AdoptHorizon(ctx, sqldb.Pgx(pool), 0, time.Now())
	require.NoError(t, err)

	// A span two hours back, as an earlier run made it, holding an event
	// its consumers (at 0) accepted.
	start := dbNow(t, pool).UTC().Truncate(time.Hour).Add(-2 * time.Hour)
	_, err = pool.Exec(ctx, fmt.Sprintf(`CREATE TABLE processed_event_p%s PARTITION OF processed_event FOR VALUES FROM ('%s') TO ('%s')`,
		start.Format("200601021504"), bound(start), bound(start.Add(time.Hour))))
	require.NoError(t, err)
	id := v7(start.Add(30 * time.Minute))
	ok, err := claimTx(t, pool, s, "c", id)
	require.NoError(t, err)
	require.True(t, ok)

	for _, adopt := range []time.Duration{0, 2 * time.Hour} { // none; then one recorded over none (within the grace)
		_, _, err = s.AdoptHorizon(ctx, sqldb.Pgx(pool), adopt, time.Now())
		require.NoError(t, err)
		_, ran, err := p.PurgeNow(ctx)
		require.NoError(t, err)
		require.False(t, ran)
		ok, err = claimTx(t, pool, s, "c", id)
		require.NoError(t, err)
		require.False(t, ok, "horizon %s: the redelivery is a duplicate: its partition must not be dropped", adopt)
	}
}
