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

// A horizon widened (longer, or 0: none) after the purge deleted rows by
// the shorter one: a consumer started with the new value must not accept
// the redelivery of an event whose row was purged.
func TestHorizonWidenedAfterAPurgeNeverAcceptsAPurgedEvent(t *testing.T) {
	t.Parallel()
	for _, widened := range []time.Duration{4 * time.Hour, 0} {
		t.Run(widened.String(), func(t *testing.T) {
			t.Parallel()
			eachTarget(t, func(t *testing.T, tg target) {
				ctx := context.Background()
				short, id := rowOlderThanTheHorizon(t, tg)
				require.False(t, claimCommitted(t, tg, short, id), "expired for the 2 h consumer")
				n, _, err := tablePurger(t, tg).PurgeNow(ctx)
				require.NoError(t, err)
				require.EqualValues(t, v7ClaimRows(tg), n, "older than 2 h: purged")

				require.NoError(t, tgStore(t, tg).SetHorizon(ctx, tg.db, widened, time.Now()))
				restarted := consumerStore(t, tg, widened)
				require.False(t, claimCommitted(t, tg, restarted, id),
					"its row was purged: the redelivery must be refused as expired, not applied again")
			})
		})
	}
}

// rowOlderThanTheHorizon makes tg's table keep a horizon of 2 h (short,
// a consumer's store at 2 h) and holds the row of id, an event 3 h old
// that a consumer with a 4 h window claimed when it was fresh: the row
// the next purge deletes.
func rowOlderThanTheHorizon(t *testing.T, tg target) (short *processedstore.Store, id uuid.UUID) {
	t.Helper()
	tg.store(t)
	short = consumerStore(t, tg, 2*time.Hour)
	require.Equal(t, 2*time.Hour, short.Horizon())
	id = v7At(time.Now().Add(-3 * time.Hour))
	writer, err := processedstore.NewStore(processedstore.Config{Dialect: tg.dialect, Horizon: 4 * time.Hour})
	require.NoError(t, err)
	require.True(t, claimCommitted(t, tg, writer, id))
	return short, id
}

// The purge's mark narrows nothing while the horizon stays: a consumer
// started after a purge by its own horizon keeps that horizon and accepts
// an event just inside it; one started after a widening gets the time since
// the mark (under the old horizon, over the slack), and keeps refusing
// what the old horizon purged.
func TestPurgeMarkNarrowsOnlyAWidenedHorizon(t *testing.T) {
	t.Parallel()
	eachTarget(t, func(t *testing.T, tg target) {
		ctx := context.Background()
		tg.store(t)
		first := consumerStore(t, tg, 2*time.Hour)
		require.False(t, claimCommitted(t, tg, first, v7At(time.Now().Add(-3*time.Hour))), "expired before any purge")
		_, _, err := tablePurger(t, tg).PurgeNow(ctx)
		require.NoError(t, err)

		again := consumerStore(t, tg, 2*time.Hour)
		require.Equal(t, 2*time.Hour, again.Horizon(), "a purge by the table's own horizon narrows nothing")
		require.True(t, claimCommitted(t, tg, again, v7At(time.Now().Add(-2*time.Hour+time.Minute))), "inside the horizon: applied")

		require.NoError(t, tgStore(t, tg).SetHorizon(ctx, tg.db, 6*time.Hour, time.Now()))
		widened := consumerStore(t, tg, 6*time.Hour)
		require.Less(t, widened.Horizon(), 2*time.Hour, "the rows the 2 h purge deleted stay refused")
		require.Greater(t, widened.Horizon(), 2*time.Hour-10*time.Minute, "by the mark's slack at most")
	})
}

// A purge run that read the table's horizon before it was widened, and
// deletes only after a consumer restarted with the wider one read the
// purge mark: the consumer must still refuse what that run deletes.
// (The purge stalls between reading the horizon and writing its mark: a
// pool wait, a lock wait, a slow network; here another transaction holds
// the mark's row.)
func TestPurgeThatReadTheHorizonBeforeAWideningNeverLetsARestartedConsumerApplyAPurgedEvent(t *testing.T) {
	t.Parallel()
	eachTarget(t, func(t *testing.T, tg target) {
		ctx := context.Background()
		_, id := rowOlderThanTheHorizon(t, tg)

		var restarted *processedstore.Store
		if tg.dialect == sqldb.SQLite {
			// One writer: a purge run and a change of the horizon are
			// serialised whole, so the run cannot stall between its
			// read and its mark; the order left is purge, then widening.
			_, _, err := tablePurger(t, tg).PurgeNow(ctx)
			require.NoError(t, err)
			require.NoError(t, tgStore(t, tg).SetHorizon(ctx, tg.db, 6*time.Hour, time.Now()))
			restarted = consumerStore(t, tg, 6*time.Hour)
		} else {
			holder, release := tg.begin(t)
			_, err := holder.Exec(ctx, "INSERT INTO processed_event_horizon (id, horizon_us, previous_us, changed_us) VALUES (2, 0, 0, 0)")
			require.NoError(t, err)
			done := make(chan error, 1)
			go func() {
				_, _, err := tablePurger(t, tg).PurgeNow(ctx)
				done <- err
			}()
			waitBlockedBy(t, tg, holder) // the run has read 2 h and waits to write its mark

			require.NoError(t, tgStore(t, tg).SetHorizon(ctx, tg.db, 6*time.Hour, time.Now()))
			restarted = consumerStore(t, tg, 6*time.Hour)
			release(false)
			require.NoError(t, <-done)
		}
		// Whether the run deleted the row or not, its redelivery is never
		// applied again: refused as expired, or found as a duplicate.
		require.False(t, claimCommitted(t, tg, restarted, id),
			"a purge run that read the 2 h horizon: the redelivery must be refused or found, not applied again")
	})
}

// waitBlockedBy waits until another session waits for a lock holder's
// transaction holds (PostgreSQL: pg_blocking_pids), or, on MariaDB, until
// the purge mark's statement runs in the test's database.
func waitBlockedBy(t *testing.T, tg target, holder sqldb.Querier) {
	t.Helper()
	ctx := context.Background()
	var me int64
	var waiting string
	switch tg.dialect {
	case sqldb.PostgreSQL:
		require.NoError(t, holder.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&me))
		waiting = "SELECT count(*) FROM pg_stat_activity WHERE $1::int = ANY(pg_blocking_pids(pid))"
	default:
		// The mark's statement running in this database on a session other
		// than the holder's.
		require.NoError(t, holder.QueryRow(ctx, "SELECT CONNECTION_ID()").Scan(&me))
		waiting = "SELECT count(*) FROM information_schema.PROCESSLIST WHERE ID <> ? AND DB = DATABASE() AND INFO LIKE '%horizon%VALUES (2,%' AND INFO NOT LIKE '%PROCESSLIST%'"
	}
	testenv.Eventually(t, 30*time.Second, "a statement waits for the held mark row", func(o *testenv.Observed) bool {
		var n int
		require.NoError(t, tg.db.QueryRow(ctx, waiting, me).Scan(&n))
		return testenv.See(o, "waiting", n) > 0
	})
}
