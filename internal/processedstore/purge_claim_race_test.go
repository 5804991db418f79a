package processedstore_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// retention.md: "A row purged at time P had event_at < P - horizon, so at
// any later time the claim refuses a redelivery of its event. ... a
// redelivery either finds its row or is refused: never applied twice."
//
// A redelivery's claim runs in a transaction that began before the purge's
// (the handler's transaction, or watermill-sql's subscriber transaction
// spanning a batch). The claim's window is judged by now(), the
// transaction's start, while the purge cuts at its own, later now(): an
// event dated between the two cutoffs was purged and then claimed again.
// The purge keeps rows a slack past their horizon, so the claim finds the
// row (a duplicate) or refuses the event: it never claims it.
func TestPurgedEventIsNeverClaimedAgainByATransactionOpenedBeforeThePurge(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	s := newStore(t, sqldb.Pgx(pool)) // horizon 1 h

	// The redelivery's transaction is open (its now() is fixed).
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	var t0 time.Time
	require.NoError(t, tx.QueryRow(ctx, `SELECT now()`).Scan(&t0))

	// The event was processed once, dated just inside t0's window.
	id := uuid.New() // v4: its time is its occurred_at
	at := t0.Add(-time.Hour + 200*time.Millisecond)
	_, err = pool.Exec(ctx, `INSERT INTO processed_event (consumer, event_id, event_at) VALUES ('c', $1, $2)`, id, at)
	require.NoError(t, err)

	// The database clock moves past the event's horizon, then the purge runs.
	purgeOnceTheClockPasses(t, pool, s, t0.Add(500*time.Millisecond))

	// The redelivery claims in its transaction, after the purge.
	claimed, err := s.ClaimAt(ctx, sqldb.Pgx(tx), "c", id, at)
	require.False(t, claimed, "the event was processed: its redelivery must find its row or be refused, never be claimed and applied a second time (err=%v)", err)
}

// retention.md: "… and one that judged its window before P and then waited
// for the row the purge was deleting (the 5 minutes are that margin: a
// lock wait, bounded by the lock timeout)". A claim judges its window when
// its statement starts, then may wait before its row goes in (here a
// BEFORE INSERT trigger waits for a lock the test holds, standing for the
// wait on a row or on the table's lock). A purge that runs during the wait
// keeps the row of an event the claim already judged inside its window,
// so the claim meets it: a duplicate, not a second application.
func TestPurgeKeepsTheRowOfAClaimWaitingAfterItsWindowCheck(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	s := newStore(t, sqldb.Pgx(pool)) // horizon 1 h
	key := time.Now().UnixNano() & 0x7fffffff
	_, err := pool.Exec(ctx, fmt.Sprintf(`CREATE FUNCTION hold_claim() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_advisory_xact_lock(%d); RETURN NEW; END $$;
CREATE TRIGGER hold_claim BEFORE INSERT ON processed_event FOR EACH ROW EXECUTE FUNCTION hold_claim()`, key))
	require.NoError(t, err)

	holder, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer holder.Release()
	var holderPID int
	require.NoError(t, holder.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&holderPID))
	type result struct {
		claimed bool
		err     error
	}

	// The event was processed once, dated margin inside the window of a
	// claim starting now. A claim that starts more than margin later (a
	// loaded machine) judges the event outside its window and returns
	// without reaching the trigger: the race did not happen, and the test
	// tries again with a wider margin.
	var r result
	for margin := 500 * time.Millisecond; ; margin *= 4 {
		require.LessOrEqual(t, margin, 32*time.Second, "no claim reached its insert within its margin")
		var t0 time.Time
		require.NoError(t, pool.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&t0))
		id, at := uuid.New(), t0.Add(-time.Hour+margin)
		_, err = pool.Exec(ctx, `INSERT INTO processed_event (consumer, event_id, event_at) VALUES ('c', $1, $2)`, id, at)
		require.NoError(t, err)
		_, err = holder.Exec(ctx, `SELECT pg_advisory_lock($1)`, key)
		require.NoError(t, err)

		done := make(chan result, 1)
		go func() {
			tx, err := pool.Begin(ctx)
			if err != nil {
				done <- result{err: err}
				return
			}
			defer func() { _ = tx.Rollback(ctx) }()
			claimed, err := s.ClaimAt(ctx, sqldb.Pgx(tx), "c", id, at) // judged now, then waits in the trigger
			done <- result{claimed, err}
		}()
		var finished *result
		testenv.Eventually(t, 30*time.Second, "the claim waits in the trigger or returns", func(o *testenv.Observed) bool {
			select {
			case got := <-done:
				finished = &got
				return true
			default:
			}
			var n int
			require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE $1::int = ANY(pg_blocking_pids(pid))`, holderPID).Scan(&n))
			return o.Int("waiting", n) > 0
		})
		if finished != nil {
			_, err = holder.Exec(ctx, `SELECT pg_advisory_unlock($1)`, key)
			require.NoError(t, err)
			require.False(t, finished.claimed, "a claim that never reached its insert claimed nothing (err=%v)", finished.err)
			t.Logf("the claim started more than %s after the event's window opened; trying again", margin)
			continue
		}
		purgeOnceTheClockPasses(t, pool, s, t0.Add(margin+500*time.Millisecond)) // the event's horizon
		_, err = holder.Exec(ctx, `SELECT pg_advisory_unlock($1)`, key)
		require.NoError(t, err)
		r = <-done
		break
	}
	require.False(t, r.claimed, "the event was processed: the waiting claim must find its row, never claim it a second time (err=%v)", r.err)
}

// purgeOnceTheClockPasses waits until the database clock is past at (an
// ordering, not a timed assertion), then runs one purge with a 1 h horizon.
func purgeOnceTheClockPasses(t *testing.T, pool *pgxpool.Pool, s *processedstore.Store, at time.Time) {
	t.Helper()
	ctx := context.Background()
	for {
		var past bool
		require.NoError(t, pool.QueryRow(ctx, `SELECT clock_timestamp() > $1::timestamptz`, at).Scan(&past))
		if past {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	p, err := processedstore.NewPurger(s, sqldb.PgxPool(pool), processedstore.PurgerConfig{Horizon: time.Hour}, nil)
	require.NoError(t, err)
	_, _, err = p.PurgeNow(ctx)
	require.NoError(t, err)
}
