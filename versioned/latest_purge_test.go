package versioned_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/sqldb"
	"github.com/watermill-idempotency/idempotency/versioned"
)

func TestFamilyPurgerConfigValidate(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Pool(t)
	s, err := versioned.NewFamilyStore(versioned.FamilyStoreConfig{})
	require.NoError(t, err)
	_, err = versioned.NewFamilyPurger(s, sqldb.PgxPool(pool), versioned.FamilyPurgerConfig{}, nil)
	require.ErrorContains(t, err, "FamilyPurgerConfig.Horizon")
	_, err = versioned.NewFamilyPurger(s, sqldb.PgxPool(pool), versioned.FamilyPurgerConfig{Horizon: time.Minute}, nil)
	require.ErrorIs(t, err, versioned.ErrFamilyHorizonTooShort)
	_, err = versioned.NewFamilyPurger(s, sqldb.PgxPool(pool), versioned.FamilyPurgerConfig{Horizon: time.Hour, BatchSize: -1}, nil)
	require.ErrorContains(t, err, "FamilyPurgerConfig.BatchSize")
	_, err = versioned.NewFamilyPurger(nil, sqldb.PgxPool(pool), versioned.FamilyPurgerConfig{Horizon: time.Hour}, nil)
	require.Error(t, err)
	_, err = versioned.NewFamilyPurger(s, sqldb.PgxPool(pool), versioned.FamilyPurgerConfig{Horizon: time.Minute, MinHorizon: time.Second}, nil)
	require.NoError(t, err)
}

// Families idle longer than the horizon go, from both tables, in bounded
// batches; active ones stay; the cutoff is the database clock's whatever
// the session time zone.
func TestFamilyPurgeIdle(t *testing.T) {
	t.Parallel()
	schema := testenv.Schema(t)
	cfg := testenv.PoolConfig(t, testenv.PostgresURL(), schema, 4)
	cfg.ConnConfig.RuntimeParams["timezone"] = "Pacific/Kiritimati"
	pool := testenv.PoolOn(t, schema, 4)
	ctx := context.Background()
	s := migratedFamilies(t, sqldb.Pgx(pool))
	for i := 0; i < 7; i++ {
		f := versioned.Family{Kind: "k", ID: fmt.Sprint(i)}
		pos := versioned.SeqPosition(1, uuid.Must(uuid.NewV7()))
		_, err := s.Advance(ctx, sqldb.Pgx(pool), f, pos)
		require.NoError(t, err)
		_, err = s.RecordApplied(ctx, sqldb.Pgx(pool), "c", f, pos)
		require.NoError(t, err)
	}
	// Families 0-4 idle for 2 hours (both tables), 5 and 6 for 59 minutes.
	for _, table := range []string{"family_latest", "family_applied"} {
		_, err := pool.Exec(ctx, `UPDATE `+table+` SET updated_at = now() - CASE WHEN family_id::int < 5 THEN interval '2 hours' ELSE interval '59 minutes' END`)
		require.NoError(t, err)
	}
	n, err := s.PurgeBatch(ctx, sqldb.Pgx(pool), time.Hour, 3)
	require.NoError(t, err)
	require.EqualValues(t, 3, n, "bounded by the batch size")

	tzPool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(tzPool.Close)
	purger, err := versioned.NewFamilyPurger(s, sqldb.PgxPool(tzPool), versioned.FamilyPurgerConfig{Horizon: time.Hour, BatchSize: 2}, nil)
	require.NoError(t, err)
	n, ran, err := purger.PurgeNow(ctx)
	require.NoError(t, err)
	require.True(t, ran)
	require.EqualValues(t, 7, n, "the remaining 2 latest and 5 applied rows, in batches of 2")
	var latest, applied int
	require.NoError(t, pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM family_latest), (SELECT count(*) FROM family_applied)`).Scan(&latest, &applied))
	require.Equal(t, 2, latest)
	require.Equal(t, 2, applied)
}

// Two purgers at once: while one holds the lock, the other skips its run.
func TestFamilyPurgersOneAtATime(t *testing.T) {
	t.Parallel()
	pool, schema := testenv.Pool(t)
	ctx := context.Background()
	s := migratedFamilies(t, sqldb.Pgx(pool))
	_, err := pool.Exec(ctx, `INSERT INTO family_latest (family_kind, family_id, order_key, event_id, updated_at)
		SELECT 'k', g::text, '\x00'::bytea, gen_random_uuid(), now() - interval '2 hours' FROM generate_series(1, 30) g`)
	require.NoError(t, err)
	inRun, release := make(chan struct{}), make(chan struct{})
	first, err := versioned.NewFamilyPurger(s, sqldb.PgxPool(pool), versioned.FamilyPurgerConfig{
		Horizon: time.Hour,
		OnPurge: func(int64, time.Time) { close(inRun); <-release },
	}, nil)
	require.NoError(t, err)
	second, err := versioned.NewFamilyPurger(s, sqldb.PgxPool(testenv.PoolOn(t, schema, 2)), versioned.FamilyPurgerConfig{Horizon: time.Hour}, nil)
	require.NoError(t, err)
	done := make(chan int64, 1)
	go func() {
		n, _, err := first.PurgeNow(ctx)
		if err != nil {
			t.Error(err)
		}
		done <- n
	}()
	<-inRun
	n, ran, err := second.PurgeNow(ctx)
	require.NoError(t, err)
	require.False(t, ran)
	require.Zero(t, n)
	close(release)
	require.EqualValues(t, 30, <-done)
	_, ran, err = second.PurgeNow(ctx)
	require.NoError(t, err)
	require.True(t, ran, "the lock is released after the run")
}

func TestFamilyPurgerStartStop(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	s := migratedFamilies(t, sqldb.Pgx(pool))
	_, err := pool.Exec(ctx, `INSERT INTO family_applied (consumer, family_kind, family_id, order_key, event_id, updated_at)
		VALUES ('c', 'k', 'i', '\x00'::bytea, gen_random_uuid(), now() - interval '2 hours')`)
	require.NoError(t, err)
	runs := make(chan int64, 16)
	p, err := versioned.NewFamilyPurger(s, sqldb.PgxPool(pool), versioned.FamilyPurgerConfig{
		Horizon:  time.Hour,
		Interval: time.Millisecond,
		OnPurge:  func(n int64, _ time.Time) { runs <- n },
	}, nil)
	require.NoError(t, err)
	p.Stop() // without Start: a no-op
	require.NoError(t, p.Start(ctx))
	require.Error(t, p.Start(ctx), "started twice")
	select {
	case n := <-runs:
		require.EqualValues(t, 1, n)
	case <-time.After(30 * time.Second):
		t.Fatal("no purge run")
	}
	p.Stop()
	p.Stop()
	// Stopped: no run is in progress, and none starts any more.
	for len(runs) > 0 {
		<-runs
	}
	require.NoError(t, p.Start(ctx), "can start again after Stop")
	p.Stop()
}
