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

// partition.go: "a partition is never dropped while a redelivery of one of
// its events could still be accepted". A redelivery's claim in a
// transaction opened before the drop (watermill-sql's subscriber batch, a
// slow handler prologue) was judged by its transaction's start, now(): the
// event's partition was dropped under it and the claim landed in the
// default partition, the event applied a second time. The claim judges its
// window by its statement's start. Here the partitions are maintained with
// the claim's own horizon (no purger slack) a second after the
// transaction began (a wait on the database clock: an ordering, not a timed
// assertion); the claim must refuse the event.
func TestPartitionDropNeverLetsARedeliveryOfAnOpenTransactionBeClaimedAgain(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Pool(t)
	ctx := context.Background()

	// The redelivery's transaction is open: its now() is t0.
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	var t0 time.Time
	require.NoError(t, tx.QueryRow(ctx, `SELECT now()`).Scan(&t0))
	t0 = t0.UTC()

	// A span [bd-1min, bd) and a horizon putting t0's window start 500 ms
	// before bd: an event at bd-200ms is inside t0's window.
	bd := t0.Truncate(time.Minute).Add(-61 * time.Minute) // horizon ≥ MinHorizon (1 h)
	h := t0.Sub(bd) + 500*time.Millisecond
	s := partitionedStore(t, time.Minute, h)
	require.NoError(t, s.Migrate(ctx, sqldb.Pgx(pool)))
	_, err = pool.Exec(ctx, fmt.Sprintf(`CREATE TABLE processed_event_p%s PARTITION OF processed_event FOR VALUES FROM ('%s') TO ('%s')`,
		bd.Add(-time.Minute).Format("200601021504"), bound(bd.Add(-time.Minute)), bound(bd)))
	require.NoError(t, err)
	id := v7(bd.Add(-200 * time.Millisecond))
	// The event was processed once (its row in the span's partition).
	_, err = pool.Exec(ctx, `INSERT INTO processed_event (consumer, event_id, event_at) VALUES ('c', $1, $2)`, id, bd.Add(-200*time.Millisecond))
	require.NoError(t, err)

	for { // the DB clock passes t0 + 1 s (ordering)
		var past bool
		require.NoError(t, pool.QueryRow(ctx, `SELECT clock_timestamp() > $1::timestamptz + interval '1 second'`, t0).Scan(&past))
		if past {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	rep, err := s.MaintainPartitions(ctx, sqldb.Pgx(pool), h)
	require.NoError(t, err)
	require.NotEmpty(t, rep.Dropped, "precondition: the event's partition is dropped")

	claimed, err := s.ClaimAt(ctx, sqldb.Pgx(tx), "c", id, time.Time{})
	require.False(t, claimed, "the event was processed: its redelivery must find its row or be refused, never be claimed a second time")
	require.ErrorIs(t, err, processedstore.ErrExpired)
}
