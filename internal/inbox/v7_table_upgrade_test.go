package inbox_test

import (
	"context"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// releaseHandler is a consumer's middleware on pool over store, whose
// effect row is noted note.
func releaseHandler(t *testing.T, pool *pgxpool.Pool, store *processedstore.Store, note string) func(uuid.UUID, string) error {
	t.Helper()
	beginner, err := inbox.NewPgxBeginner(pool, inbox.PgxBeginnerConfig{})
	require.NoError(t, err)
	m, err := inbox.NewIdempotent(inbox.Config{Beginner: beginner, Store: store, Consumer: "stock"}, watermill.NopLogger{})
	require.NoError(t, err)
	h := m.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := inbox.PgxTxFromContext(msg.Context())
		_, err := tx.Exec(msg.Context(), `INSERT INTO effect (event_id, note) VALUES ($1, $2)`, msg.UUID, note)
		return nil, err
	})
	return func(id uuid.UUID, payload string) error {
		_, err := h(preparedClaimMsg(t, id, payload))
		return err
	}
}

// A rolling deploy of the UUIDv7 claim table (migration 0008): events
// the previous release claimed before the migration stay duplicates for
// the new one; while the migration runs and after it, consumers of the
// previous release (the lean claim on the table) and of the new one
// (UUIDv7 events claimed in processed_event_v7 only) receive the same
// events at once, and every event is applied exactly once, whichever side
// claims it. A reused id is reported as a conflict on both sides.
func TestV7TableRollingDeployAppliesEachEventOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := testenv.Pool(t)
	table := schema + ".processed_event"
	previous, err := processedstore.NewStore(processedstore.Config{Table: table, Horizon: time.Hour})
	require.NoError(t, err)
	ms, err := previous.Migrations()
	require.NoError(t, err)
	require.Len(t, ms, 9)
	// The previous release's schema: migrations 1 to 7.
	require.NoError(t, sqldb.Migrate(ctx, sqldb.Pgx(pool), sqldb.PostgreSQL, "processed:"+previous.Table().String(), ms[:7]))
	require.NoError(t, previous.CheckLean(ctx, sqldb.Pgx(pool), "stock"))
	_, err = pool.Exec(ctx, `CREATE TABLE effect (id bigserial PRIMARY KEY, event_id uuid NOT NULL, note text)`)
	require.NoError(t, err)
	prev := releaseHandler(t, pool, previous, "previous")

	const payload = `{"n":1}`
	before := mixedIDs(40)
	for _, id := range before {
		require.NoError(t, prev(id, payload))
	}

	run := func(deliveries []uuid.UUID, during func(), workers ...func(uuid.UUID, string) error) {
		t.Helper()
		rand.Shuffle(len(deliveries), func(i, j int) { deliveries[i], deliveries[j] = deliveries[j], deliveries[i] })
		var next, failures atomic.Int64
		var wg sync.WaitGroup
		for _, deliver := range workers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					i := int(next.Add(1)) - 1
					if i >= len(deliveries) {
						return
					}
					if i == len(deliveries)/3 && during != nil {
						during()
					}
					for try := 0; ; try++ {
						err := deliver(deliveries[i], payload)
						if err == nil {
							break
						}
						// Held failures (a lock wait bounded by the lock
						// timeout) are retried, as the broker would.
						failures.Add(1)
						if try >= 100 {
							t.Errorf("delivery %s keeps failing: %v", deliveries[i], err)
							return
						}
						time.Sleep(time.Millisecond)
					}
				}
			}()
		}
		wg.Wait()
		t.Logf("failed attempts retried: %d", failures.Load())
	}

	// The migration runs while two workers of the previous release claim.
	first := mixedIDs(60)
	migrated := make(chan error, 1)
	var deliveries []uuid.UUID
	for i := 0; i < 2; i++ {
		deliveries = append(append(deliveries, first...), before...)
	}
	run(deliveries, func() { go func() { migrated <- previous.Migrate(ctx, sqldb.Pgx(pool)) }() }, prev, prev)
	require.NoError(t, <-migrated)

	// The new release starts: two workers of each release on the same
	// events, each delivered three times, with those claimed before.
	current, err := processedstore.NewStore(processedstore.Config{Table: table, Horizon: time.Hour})
	require.NoError(t, err)
	require.NoError(t, current.CheckLean(ctx, sqldb.Pgx(pool), "stock"))
	p, ok := current.ClaimParamsAt("stock", uuid.Must(uuid.NewV7()), time.Time{}, nil)
	require.True(t, ok)
	require.NotZero(t, p.ConsumerID, "the new release claims UUIDv7 events in the v7 table")
	require.Contains(t, p.SQL, `"processed_event_v7"`)
	next := releaseHandler(t, pool, current, "current")
	second := mixedIDs(120)
	deliveries = nil
	for i := 0; i < 3; i++ {
		deliveries = append(append(append(deliveries, second...), first...), before...)
	}
	run(deliveries, nil, prev, prev, next, next)

	// After the deploy: both releases still see every event as processed,
	// and new events once, whichever claims first.
	all := append(append(append([]uuid.UUID{}, before...), first...), second...)
	for _, id := range all {
		require.NoError(t, next(id, payload))
		require.NoError(t, prev(id, payload))
	}
	after := mixedIDs(20)
	for i, id := range after {
		if i%2 == 0 {
			require.NoError(t, next(id, payload))
			require.NoError(t, prev(id, payload))
		} else {
			require.NoError(t, prev(id, payload))
			require.NoError(t, next(id, payload))
		}
	}
	all = append(all, after...)

	var effects, distinct int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT event_id) FROM effect`).Scan(&effects, &distinct))
	require.Equal(t, len(all), effects, "every event applied exactly once")
	require.Equal(t, len(all), distinct)

	// The new release's UUIDv7 claims are in the v7 table alone (not in
	// the table) unless the previous release met them; every UUIDv7 event
	// is in the v7 table, every other one in the table only.
	var v7Only, v7Missing, otherInV7 int
	require.NoError(t, pool.QueryRow(ctx, `SELECT
    (SELECT count(*) FROM processed_event_v7 v WHERE NOT EXISTS (SELECT 1 FROM processed_event p WHERE p.event_id = v.event_id)),
    (SELECT count(*) FROM effect e WHERE get_byte(uuid_send(e.event_id), 6) >> 4 = 7
        AND NOT EXISTS (SELECT 1 FROM processed_event_v7 v WHERE v.event_id = e.event_id)),
    (SELECT count(*) FROM processed_event_v7 v WHERE get_byte(uuid_send(v.event_id), 6) >> 4 <> 7)`).Scan(&v7Only, &v7Missing, &otherInV7))
	require.Positive(t, v7Only, "UUIDv7 events claimed by the new release in the v7 table only")
	require.Zero(t, v7Missing, "every UUIDv7 event is in the v7 table")
	require.Zero(t, otherInV7)

	// A reused id: the other payload is refused as a conflict by both.
	reused := after[0]
	err = next(reused, `{"n":2}`)
	require.ErrorIs(t, err, inbox.ErrEventIDReused)
	// The v7 table keeps no event name: the reason says so rather than
	// claiming the event was processed as "".
	require.NotContains(t, err.Error(), `processed as ""`)
	require.ErrorIs(t, prev(reused, `{"n":2}`), inbox.ErrEventIDReused)
	reused = after[1]
	require.ErrorIs(t, next(reused, `{"n":2}`), inbox.ErrEventIDReused)
	require.ErrorIs(t, prev(reused, `{"n":2}`), inbox.ErrEventIDReused)
}
