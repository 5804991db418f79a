package processedstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// The partitioned layout: UUIDv7 claims land in time partitions the purger
// created ahead; other ids in the side table; the purger drops a partition
// only once its whole span is older than the purge horizon (so every
// redelivery of its events is refused by the claim), and DELETE-purges the
// default partition and the side table by event_at.
func TestPartitionedLayout(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	db := sqldb.Pgx(pool)
	const span, horizon = time.Hour, 2 * time.Hour
	s, err := processedstore.NewStore(processedstore.Config{Layout: processedstore.LayoutPartitioned, PartitionSpan: span, Horizon: horizon, MaxFutureSkew: time.Minute})
	require.NoError(t, err)
	require.NoError(t, s.Migrate(ctx, db))
	require.NoError(t, s.Migrate(ctx, db))
	p, err := processedstore.NewPurger(s, sqldb.PgxPool(pool), processedstore.PurgerConfig{}, nil)
	require.NoError(t, err)
	_, ran, err := p.PurgeNow(ctx)
	require.NoError(t, err)
	require.True(t, ran)
	parts := func() int {
		var n int
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM pg_inherits WHERE inhparent = 'processed_event'::regclass`).Scan(&n))
		return n
	}
	var kind string
	require.NoError(t, pool.QueryRow(ctx, `SELECT relkind::text FROM pg_class WHERE oid = 'processed_event'::regclass`).Scan(&kind))
	require.Equal(t, "p", kind, "a partitioned table")
	require.GreaterOrEqual(t, parts(), 1+4, "the default partition and the spans ahead")

	claim := func(id uuid.UUID, at time.Time) (bool, error) {
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = tx.Rollback(ctx) }()
		ok, err := s.ClaimAt(ctx, sqldb.Pgx(tx), "c", id, at)
		if err == nil {
			require.NoError(t, tx.Commit(ctx))
		}
		return ok, err
	}
	where := func(id uuid.UUID) string {
		var rel string
		err := pool.QueryRow(ctx, `SELECT tableoid::regclass::text FROM processed_event WHERE event_id = $1
			UNION ALL SELECT 'processed_event_other' FROM processed_event_other WHERE event_id = $1`, id).Scan(&rel)
		require.NoError(t, err)
		return rel
	}
	now := uuid.Must(uuid.NewV7())
	ok, err := claim(now, time.Time{})
	require.NoError(t, err)
	require.True(t, ok)
	require.Contains(t, where(now), "processed_event_p", "a fresh UUIDv7 lands in a time partition")
	ok, err = claim(now, time.Time{})
	require.NoError(t, err)
	require.False(t, ok, "duplicate")
	v4 := uuid.New()
	ok, err = claim(v4, time.Now())
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, "processed_event_other", where(v4))
	ok, err = s.Processed(ctx, db, "c", v4)
	require.NoError(t, err)
	require.True(t, ok)
	old := v7(time.Now().Add(-90 * time.Minute)) // before the first partition: default
	ok, err = claim(old, time.Time{})
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, "processed_event_default", where(old))
	_, err = claim(v7(time.Now().Add(-3*time.Hour)), time.Time{})
	require.ErrorIs(t, err, processedstore.ErrExpired)

	// Partitions whose whole span ended before now − horizon go (their
	// newest events are refused by the claim); one whose span ends after it
	// stays, and so do the current ones.
	for _, ago := range []time.Duration{3*time.Hour + 30*time.Minute, 2*time.Hour + 30*time.Minute} {
		start := time.Now().Add(-ago).UTC().Truncate(span)
		_, err := pool.Exec(ctx, `CREATE TABLE processed_event_p`+start.Format("200601021504")+` PARTITION OF processed_event FOR VALUES FROM ('`+bound(start).String()+`') TO ('`+bound(start.Add(span)).String()+`')`)
		require.NoError(t, err)
	}
	before := parts()
	// The default partition's row is older than the horizon once aged.
	_, err = pool.Exec(ctx, `UPDATE processed_event_default SET event_at = now() - interval '3 hours'`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `UPDATE processed_event_other SET event_at = now() - interval '3 hours'`)
	require.NoError(t, err)
	n, _, err := p.PurgeNow(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 2, n, "the default partition's and the side table's rows, by DELETE")
	// Which of the two spans ended before now − horizon − the purger's
	// slack depends on the
	// minute the test runs: count the expected drops by the rule itself.
	want, cutoff := 0, time.Now().Add(-horizon-processedstore.PurgeClaimSlack)
	for _, ago := range []time.Duration{3*time.Hour + 30*time.Minute, 2*time.Hour + 30*time.Minute} {
		if !time.Now().Add(-ago).UTC().Truncate(span).Add(span).After(cutoff) {
			want++
		}
	}
	require.GreaterOrEqual(t, want, 1)
	require.Equal(t, want, before-parts(), "exactly the partitions whose whole span is past the horizon are dropped")
	ok, err = s.Processed(ctx, db, "c", now)
	require.NoError(t, err)
	require.True(t, ok, "the current partition is untouched")
}

func bound(t time.Time) uuid.UUID {
	var id uuid.UUID
	ms := uint64(t.UnixMilli())
	for i := 5; i >= 0; i-- {
		id[i] = byte(ms)
		ms >>= 8
	}
	return id
}

func v7(at time.Time) uuid.UUID { return v7At(at) }
