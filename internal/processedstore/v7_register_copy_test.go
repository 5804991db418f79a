package processedstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// lateClaims migrates schema's processed_event (so <table>_v7 is ready)
// and claims n UUIDv7 events for consumer through the table's claim
// before any process registered the name: they are in the table only.
func lateClaims(t *testing.T, pool *pgxpool.Pool, schema, consumer string, n int) []uuid.UUID {
	t.Helper()
	ctx := context.Background()
	old := v7Store(t, pool, schema, "")
	var ids []uuid.UUID
	for i := 0; i < n; i++ {
		id := uuid.Must(uuid.NewV7())
		ok, err := old.Claim(ctx, sqldb.Pgx(pool), consumer, id)
		require.NoError(t, err)
		require.True(t, ok)
		ids = append(ids, id)
	}
	return ids
}

// inFlightClaim opens a transaction holding an uncommitted claim of another
// consumer in the table (a handler still running) and returns its end.
func inFlightClaim(t *testing.T, pool *pgxpool.Pool) func() {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `INSERT INTO processed_event (consumer, event_id, event_at) VALUES ('busy', $1, now())`, uuid.Must(uuid.NewV7()))
	require.NoError(t, err)
	done := false
	end := func() {
		if !done {
			done = true
			_ = tx.Rollback(ctx)
		}
	}
	t.Cleanup(end)
	return end
}

// Two processes of this release start a consumer name at once, while a
// claim of another consumer is in flight, after that name claimed events
// through the table before any of them registered it: both start without
// waiting for the claim in flight, and for both those events are
// duplicates in processed_event_v7.
func TestSecondInstanceOfANewlyRegisteredConsumerSeesItsEarlierClaims(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := testenv.Pool(t)
	ids := lateClaims(t, pool, schema, "late", 3)
	end := inFlightClaim(t, pool)
	defer end()
	stores := make(chan *processedstore.Store, 2)
	errs := make(chan error, 2)
	for i := 0; i < 2; i++ {
		go func() {
			s, err := processedstore.NewStore(processedstore.Config{Table: schema + ".processed_event", Horizon: time.Hour})
			if err == nil {
				err = s.CheckLean(ctx, sqldb.Pgx(pool), "late")
			}
			errs <- err
			stores <- s
		}()
	}
	for i := 0; i < 2; i++ {
		require.NoError(t, <-errs)
		s := <-stores
		for _, id := range ids {
			require.False(t, claimV7(t, pool, s, "late", id), "event %s processed before is claimed again", id)
		}
	}
}

// A consumer of a new name starts while another consumer's handler
// transaction is open (a claim in flight): its registration takes no lock
// on the table, so a claim made in the table meanwhile (an id that is not
// a UUIDv7, bounded here by a lock timeout of 1 s) does not wait for it,
// and the start does not wait for the claim in flight.
func TestRegisteringAConsumerNameDoesNotStallOtherClaims(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := testenv.Pool(t)
	other := v7Store(t, pool, schema, "billing")

	end := inFlightClaim(t, pool)
	defer end()
	starting, err := processedstore.NewStore(processedstore.Config{Table: schema + ".processed_event", Horizon: time.Hour})
	require.NoError(t, err)
	require.NoError(t, starting.CheckLean(ctx, sqldb.Pgx(pool), "shipping"))
	p, ok := starting.ClaimParamsAt("shipping", uuid.Must(uuid.NewV7()), time.Time{}, nil)
	require.True(t, ok)
	require.NotZero(t, p.ConsumerID)

	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	tx, err := conn.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, `SET LOCAL lock_timeout = '1s'`)
	require.NoError(t, err)
	ok, err = other.Claim(ctx, sqldb.Pgx(tx), "billing", uuid.New()) // not a UUIDv7: the table
	require.NoError(t, err)
	require.True(t, ok)
}
