package processedstore_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

func TestPurgerConfigValidate(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Pool(t)
	none, err := processedstore.NewStore(processedstore.Config{})
	require.NoError(t, err)
	_, err = processedstore.NewPurger(none, sqldb.PgxPool(pool), processedstore.PurgerConfig{}, nil)
	require.ErrorContains(t, err, "PurgerConfig.Horizon")
	// A store whose claim refuses nothing cannot be purged safely.
	_, err = processedstore.NewPurger(none, sqldb.PgxPool(pool), processedstore.PurgerConfig{Horizon: time.Hour}, nil)
	require.ErrorIs(t, err, processedstore.ErrHorizonBelowClaim)

	s, err := processedstore.NewStore(processedstore.Config{Horizon: time.Minute})
	require.NoError(t, err)
	_, err = processedstore.NewPurger(s, sqldb.PgxPool(pool), processedstore.PurgerConfig{}, nil)
	require.ErrorIs(t, err, processedstore.ErrHorizonTooShort, "the store's horizon is the default, and it is below MinHorizon")
	p, err := processedstore.NewPurger(s, sqldb.PgxPool(pool), processedstore.PurgerConfig{MinHorizon: time.Second}, nil)
	require.NoError(t, err)
	require.NotNil(t, p)
	_, err = processedstore.NewPurger(s, sqldb.PgxPool(pool), processedstore.PurgerConfig{Horizon: 59 * time.Second, MinHorizon: time.Second}, nil)
	require.ErrorIs(t, err, processedstore.ErrHorizonBelowClaim, "purging before the claim refuses would apply redeliveries twice")
	_, err = processedstore.NewPurger(s, sqldb.PgxPool(pool), processedstore.PurgerConfig{Horizon: time.Hour}, nil)
	require.NoError(t, err, "a longer purge horizon is safe")
}

// Rows just inside and just outside the horizon, purged by a process whose
// TZ and whose database session's timezone are set far from UTC and from
// each other: the cutoff is the database clock's, nothing else.
func TestPurgeHorizonAnyTimeZone(t *testing.T) {
	t.Parallel()
	for _, zones := range [][2]string{
		{"America/Anchorage", "Pacific/Kiritimati"}, // process −9/−8, session +14
		{"Pacific/Kiritimati", "America/Anchorage"},
		{"UTC", "UTC"},
	} {
		t.Run(zones[0]+"_"+zones[1], func(t *testing.T) {
			t.Parallel()
			pool, schema := testenv.Pool(t)
			ctx := context.Background()
			s := newStore(t, sqldb.Pgx(pool))
			inside, outside := uuid.Must(uuid.NewV7()), uuid.Must(uuid.NewV7())
			_, err := pool.Exec(ctx, `INSERT INTO processed_event (consumer, event_id, event_at) VALUES
				('c', $1, now() - interval '59 minutes'), ('c', $2, now() - interval '66 minutes')`, inside, outside) // horizon 1 h, kept 5 min more (purgeClaimSlack)
			require.NoError(t, err)

			cmd := exec.Command(os.Args[0], "-test.run=^$")
			cmd.Env = append(os.Environ(), "TZ="+zones[0], purgeChildEnv+"="+schema, "PURGE_SESSION_TZ="+zones[1])
			out, err := cmd.CombinedOutput()
			require.NoError(t, err, "child: %s", out)
			require.Equal(t, "deleted=1", strings.TrimSpace(string(out)))

			ok, err := s.Processed(ctx, sqldb.Pgx(pool), "c", inside)
			require.NoError(t, err)
			require.True(t, ok, "a row inside the horizon stays")
			ok, err = s.Processed(ctx, sqldb.Pgx(pool), "c", outside)
			require.NoError(t, err)
			require.False(t, ok, "a row outside the horizon goes")
		})
	}
}

const purgeChildEnv = "PROCESSED_TEST_PURGE_SCHEMA"

func TestMain(m *testing.M) {
	if schema := os.Getenv(purgeChildEnv); schema != "" {
		os.Exit(purgeChild(schema, os.Getenv("PURGE_SESSION_TZ")))
	}
	os.Exit(m.Run())
}

// purgeChild runs one purge with a horizon of one hour from a process whose
// TZ the parent set, on a session with the given timezone.
func purgeChild(schema, sessionTZ string) int {
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL())
	if err != nil {
		fmt.Println(err)
		return 2
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	cfg.ConnConfig.RuntimeParams["timezone"] = sessionTZ
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		fmt.Println(err)
		return 2
	}
	defer pool.Close()
	s, _ := processedstore.NewStore(processedstore.Config{Horizon: time.Hour})
	p, err := processedstore.NewPurger(s, sqldb.PgxPool(pool), processedstore.PurgerConfig{Horizon: time.Hour}, nil)
	if err != nil {
		fmt.Println(err)
		return 2
	}
	n, ran, err := p.PurgeNow(ctx)
	if err != nil || !ran {
		fmt.Println(err, ran)
		return 3
	}
	fmt.Printf("deleted=%d\n", n)
	return 0
}

// Two purgers at once: while one holds the lock, the other skips its run.
func TestTwoPurgersOneWorks(t *testing.T) {
	t.Parallel()
	pool, schema := testenv.Pool(t)
	ctx := context.Background()
	s := newStore(t, sqldb.Pgx(pool))
	_, err := pool.Exec(ctx, `INSERT INTO processed_event (consumer, event_id, event_at)
		SELECT 'c', gen_random_uuid(), now() - interval '2 hours' FROM generate_series(1, 50)`)
	require.NoError(t, err)
	inRun := make(chan struct{})
	release := make(chan struct{})
	first, err := processedstore.NewPurger(s, sqldb.PgxPool(pool), processedstore.PurgerConfig{
		Horizon: time.Hour,
		OnPurge: func(int64, time.Time) { close(inRun); <-release }, // called while holding the lock
	}, nil)
	require.NoError(t, err)
	second, err := processedstore.NewPurger(s, sqldb.PgxPool(testenv.PoolOn(t, schema, 2)), processedstore.PurgerConfig{Horizon: time.Hour}, nil)
	require.NoError(t, err)
	done := make(chan int64, 1)
	go func() {
		n, _, err := first.PurgeNow(ctx)
		require.NoError(t, err)
		done <- n
	}()
	<-inRun
	n, ran, err := second.PurgeNow(ctx)
	require.NoError(t, err)
	require.False(t, ran, "the second purger must skip while the first holds the lock")
	require.Zero(t, n)
	close(release)
	require.EqualValues(t, 50, <-done)
	_, ran, err = second.PurgeNow(ctx)
	require.NoError(t, err)
	require.True(t, ran, "the lock is released after the run")
}

func TestPurgerStartStop(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	s := newStore(t, sqldb.Pgx(pool))
	_, err := pool.Exec(ctx, `INSERT INTO processed_event (consumer, event_id, event_at)
		SELECT 'c', gen_random_uuid(), now() - interval '2 hours' FROM generate_series(1, 10)`)
	require.NoError(t, err)
	var total atomic.Int64
	p, err := processedstore.NewPurger(s, sqldb.PgxPool(pool), processedstore.PurgerConfig{
		Horizon: time.Hour, Interval: 10 * time.Millisecond, BatchSize: 3,
		OnPurge: func(n int64, _ time.Time) { total.Add(n) },
	}, nil)
	require.NoError(t, err)
	require.NoError(t, p.Start(ctx))
	require.Error(t, p.Start(ctx))
	require.Eventually(t, func() bool { return total.Load() == 10 }, 10*time.Second, 10*time.Millisecond)
	p.Stop()
	p.Stop()
}

// Purge of a backlog of 200k rows (50 batches) while consumers claim: every
// batch is its own short transaction of at most BatchSize rows (a
// statement-level trigger records each deleting transaction), so a claim can
// wait on at most one batch; and claims, including re-claims of rows being
// purged, go on during the purge.
func TestPurgeOfALargeBacklogRunsInBoundedBatchesWhileClaiming(t *testing.T) {
	t.Parallel()
	const rows, batch = 200_000, 4_000
	pool, schema := testenv.Pool(t)
	ctx := context.Background()
	s := newStore(t, sqldb.Pgx(pool))
	_, err := pool.Exec(ctx, `INSERT INTO processed_event (consumer, event_id, event_at)
		SELECT 'old', gen_random_uuid(), now() - interval '2 hours' FROM generate_series(1, $1::int)`, rows)
	require.NoError(t, err)
	var sample []uuid.UUID
	r, err := pool.Query(ctx, `SELECT event_id FROM processed_event TABLESAMPLE SYSTEM (0.1) LIMIT 200`)
	require.NoError(t, err)
	for r.Next() {
		var id uuid.UUID
		require.NoError(t, r.Scan(&id))
		sample = append(sample, id)
	}
	require.NoError(t, r.Err())
	_, err = pool.Exec(ctx, `
		CREATE TABLE purge_log (xid xid8, deleted bigint);
		CREATE FUNCTION log_purge() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN INSERT INTO purge_log SELECT pg_current_xact_id(), count(*) FROM old; RETURN NULL; END $$;
		CREATE TRIGGER purge_logger AFTER DELETE ON processed_event
		REFERENCING OLD TABLE AS old FOR EACH STATEMENT EXECUTE FUNCTION log_purge();`)
	require.NoError(t, err)

	purger, err := processedstore.NewPurger(s, sqldb.PgxPool(testenv.PoolOn(t, schema, 2)),
		processedstore.PurgerConfig{Horizon: time.Hour, BatchSize: batch}, nil)
	require.NoError(t, err)
	purgeDone := make(chan struct{})
	var claims atomic.Int64
	var wg sync.WaitGroup
	claimPool := testenv.PoolOn(t, schema, 4)
	for w := 0; w < 2; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-purgeDone:
					return
				default:
				}
				tx, err := claimPool.Begin(ctx)
				if !assertNoErr(t, err) {
					return
				}
				id := uuid.Must(uuid.NewV7())
				consumer := "new"
				if i%2 == 1 && len(sample) > 0 { // an old key the purge is deleting
					id, consumer = sample[(i+w)%len(sample)], "old"
				}
				_, err = s.Claim(ctx, sqldb.Pgx(tx), consumer, id)
				if !assertNoErr(t, err) {
					_ = tx.Rollback(ctx)
					return
				}
				if !assertNoErr(t, tx.Commit(ctx)) {
					return
				}
				claims.Add(1)
			}
		}(w)
	}
	n, ran, err := purger.PurgeNow(ctx)
	close(purgeDone)
	wg.Wait()
	require.NoError(t, err)
	require.True(t, ran)
	require.GreaterOrEqual(t, n, int64(rows-len(sample)))
	require.Positive(t, claims.Load(), "claims must progress during the purge")
	var txs, maxDeleted int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(DISTINCT xid), max(deleted) FROM purge_log WHERE deleted > 0`).Scan(&txs, &maxDeleted))
	require.LessOrEqual(t, maxDeleted, int64(batch), "no transaction deletes more than one batch")
	require.GreaterOrEqual(t, txs, int64(rows/batch), "one transaction per batch")
	var left int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM processed_event WHERE event_at < now() - interval '1 hour'`).Scan(&left))
	require.Zero(t, left)
	t.Logf("purged %d rows in %d transactions while %d claims committed", n, txs, claims.Load())
}

func assertNoErr(t *testing.T, err error) bool {
	if err != nil {
		t.Error(err)
		return false
	}
	return true
}
