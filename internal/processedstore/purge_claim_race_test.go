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

	// The database clock moves past the event's horizon (an ordering, not a
	// timed assertion).
	for {
		var past bool
		require.NoError(t, pool.QueryRow(ctx, `SELECT clock_timestamp() > $1::timestamptz + interval '500 milliseconds'`, t0).Scan(&past))
		if past {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	p, err := processedstore.NewPurger(s, sqldb.PgxPool(pool), processedstore.PurgerConfig{Horizon: time.Hour}, nil)
	require.NoError(t, err)
	_, _, err = p.PurgeNow(ctx)
	require.NoError(t, err)

	// The redelivery claims in its transaction, after the purge.
	claimed, err := s.ClaimAt(ctx, sqldb.Pgx(tx), "c", id, at)
	require.False(t, claimed, "the event was processed: its redelivery must find its row or be refused, never be claimed and applied a second time (err=%v)", err)
}
