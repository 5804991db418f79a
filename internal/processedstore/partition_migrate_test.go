package processedstore_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand"
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

// event is one message of the test: its id and its envelope's occurred_at
// (what a redelivery carries again).
type event struct {
	id uuid.UUID
	at time.Time
}

// consume is a consumer's handling of one delivery: the claim and the
// effect (a row of effect) in one transaction. It returns whether the
// effect was applied, and the claim's refusal, if any.
func consume(ctx context.Context, pool *pgxpool.Pool, s *processedstore.Store, e event) (bool, error) {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return false, err
	}
	defer func() { _ = tx.Rollback(ctx) }()
	ok, err := s.ClaimAt(ctx, sqldb.Pgx(tx), "c", e.id, e.at)
	if err != nil || !ok {
		return false, err
	}
	if _, err := tx.Exec(ctx, `INSERT INTO effect (event_id) VALUES ($1)`, e.id); err != nil {
		return false, err
	}
	return true, tx.Commit(ctx)
}

// The upgrade of a plain table to the partitioned layout while consumers
// run: consumers still configured with the plain layout keep claiming
// (new events and redeliveries, UUIDv7 and v4 ids) across the switch, and
// consumers with the partitioned layout join once it is done. No event's
// effect is applied twice, every redelivery of an event processed before
// the switch is a duplicate or refused as expired, and no consumer fails.
// The purger then empties the legacy table by the horizon and
// FinishPartitionMigration removes it.
func TestMigrateToPartitionedWhileConsuming(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	const horizon = 2 * time.Hour
	plain, err := processedstore.NewStore(processedstore.Config{Horizon: horizon})
	require.NoError(t, err)
	part, err := processedstore.NewStore(processedstore.Config{Layout: processedstore.LayoutPartitioned, PartitionSpan: time.Hour, Horizon: horizon})
	require.NoError(t, err)
	require.NoError(t, plain.Migrate(ctx, sqldb.Pgx(pool)))
	_, err = pool.Exec(ctx, `CREATE TABLE effect (event_id uuid NOT NULL)`)
	require.NoError(t, err)
	now := dbNow(t, pool)

	// Before the switch: UUIDv7 events of the last 90 minutes and of the
	// current second, v4 events with an occurred_at, and v4 events whose
	// rows are past the horizon (their redelivery is refused).
	var before, expired []event
	for i := 0; i < 150; i++ {
		var e event
		switch i % 3 {
		case 0:
			e = event{id: v7(now.Add(-time.Duration(i) * 30 * time.Second))}
		case 1:
			e = event{id: uuid.Must(uuid.NewV7())}
		default:
			e = event{id: uuid.New(), at: now.Add(-time.Duration(i) * time.Second)}
		}
		ok, err := consume(ctx, pool, plain, e)
		require.NoError(t, err)
		require.True(t, ok)
		before = append(before, e)
	}
	for i := 0; i < 20; i++ {
		e := event{id: uuid.New(), at: now.Add(-3 * time.Hour)}
		_, err := pool.Exec(ctx, `INSERT INTO processed_event (consumer, event_id, event_at) VALUES ('c', $1, $2)`, e.id, e.at)
		require.NoError(t, err)
		_, err = pool.Exec(ctx, `INSERT INTO effect (event_id) VALUES ($1)`, e.id)
		require.NoError(t, err)
		expired = append(expired, e)
	}

	// Consumers: each goroutine redelivers events seen so far and sends
	// new ones, until stopped.
	var mu sync.Mutex
	seen := append([]event(nil), before...)
	pick := func(r *rand.Rand) event {
		mu.Lock()
		defer mu.Unlock()
		return seen[r.Intn(len(seen))]
	}
	add := func(e event) {
		mu.Lock()
		seen = append(seen, e)
		mu.Unlock()
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var failures []error
	var fmu sync.Mutex
	var rounds atomic.Int64
	run := func(s *processedstore.Store, seed int64) {
		defer wg.Done()
		r := rand.New(rand.NewSource(seed))
		for {
			select {
			case <-stop:
				return
			default:
			}
			var e event
			switch r.Intn(4) {
			case 0:
				e = event{id: uuid.Must(uuid.NewV7())}
				add(e)
			case 1:
				e = event{id: uuid.New(), at: time.Now()}
				add(e)
			default:
				e = pick(r)
			}
			if _, err := consume(ctx, pool, s, e); err != nil {
				fmu.Lock()
				failures = append(failures, fmt.Errorf("%s: %w", e.id, err))
				fmu.Unlock()
			}
			rounds.Add(1)
		}
	}
	wg.Add(2)
	go run(plain, 1)
	go run(plain, 2)
	testenv.Eventually(t, 30*time.Second, "the plain consumers run", func(o *testenv.Observed) bool { return o.Int("rounds", int(rounds.Load())) > 50 })

	require.NoError(t, part.MigrateToPartitioned(ctx, sqldb.Pgx(pool)))
	require.NoError(t, part.MigrateToPartitioned(ctx, sqldb.Pgx(pool)), "again: nothing to do")
	wg.Add(2)
	go run(part, 3)
	go run(part, 4)
	mark := rounds.Load()
	testenv.Eventually(t, 60*time.Second, "both kinds of consumer run after the switch", func(o *testenv.Observed) bool {
		return o.Int("rounds since the switch", int(rounds.Load()-mark)) > 200
	})
	close(stop)
	wg.Wait()
	require.Empty(t, failures, "no consumer failed")

	var kind string
	require.NoError(t, pool.QueryRow(ctx, `SELECT relkind::text FROM pg_class WHERE oid = 'processed_event'::regclass`).Scan(&kind))
	require.Equal(t, "p", kind)
	requireAppliedOnce := func() {
		t.Helper()
		var dups []uuid.UUID
		rows, err := pool.Query(ctx, `SELECT event_id FROM effect GROUP BY event_id HAVING count(*) > 1`)
		require.NoError(t, err)
		for rows.Next() {
			var id uuid.UUID
			require.NoError(t, rows.Scan(&id))
			dups = append(dups, id)
		}
		require.NoError(t, rows.Err())
		for _, id := range dups {
			t.Logf("applied twice: %s (version %d)", id, id.Version())
		}
		require.Empty(t, dups, "no effect applied twice")
	}
	requireAppliedOnce()

	// Every event processed before the switch, redelivered to either kind
	// of consumer: a duplicate (found) or refused as expired.
	for i, e := range append(append([]event(nil), before...), expired...) {
		s := plain
		if i%2 == 0 {
			s = part
		}
		ok, err := consume(ctx, pool, s, e)
		if err != nil {
			require.ErrorIs(t, err, processedstore.ErrExpired, "event %s", e.id)
			continue
		}
		require.False(t, ok, "event %s processed before the switch is found", e.id)
	}
	requireAppliedOnce()

	// The purger empties the legacy table as its rows pass the horizon;
	// the migration ends only then.
	p, err := processedstore.NewPurger(part, sqldb.PgxPool(pool), processedstore.PurgerConfig{BatchSize: 7}, nil)
	require.NoError(t, err)
	n, _, err := p.PurgeNow(ctx)
	require.NoError(t, err)
	require.GreaterOrEqual(t, n, int64(len(expired)), "the expired legacy rows are purged")
	err = part.FinishPartitionMigration(ctx, sqldb.Pgx(pool))
	require.ErrorIs(t, err, processedstore.ErrLegacyNotEmpty)
	_, err = pool.Exec(ctx, `UPDATE processed_event_legacy SET event_at = now() - interval '3 hours'`)
	require.NoError(t, err)
	_, _, err = p.PurgeNow(ctx)
	require.NoError(t, err)
	require.NoError(t, part.FinishPartitionMigration(ctx, sqldb.Pgx(pool)))
	require.NoError(t, part.FinishPartitionMigration(ctx, sqldb.Pgx(pool)), "again: nothing to do")
	var left int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM pg_trigger tg JOIN pg_class c ON c.oid = tg.tgrelid
		WHERE tg.tgname = 'processed_event_legacy_move' AND c.relnamespace = current_schema()::regnamespace`).Scan(&left))
	require.Zero(t, left, "the triggers are gone")
	e := event{id: uuid.Must(uuid.NewV7())}
	ok, err := consume(ctx, pool, part, e)
	require.NoError(t, err)
	require.True(t, ok)
	ok, err = consume(ctx, pool, part, e)
	require.NoError(t, err)
	require.False(t, ok)
	requireAppliedOnce()
}

// The switch waits at most 5 s for its lock: behind a transaction that holds
// the plain table (a claim not yet committed) it fails with lock_timeout and
// changes nothing; run again later it succeeds, and the held claim's row,
// committed meanwhile, is found after the switch.
func TestMigrateToPartitionedBehindAnOpenClaim(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	plain, err := processedstore.NewStore(processedstore.Config{Horizon: 2 * time.Hour})
	require.NoError(t, err)
	part, err := processedstore.NewStore(processedstore.Config{Layout: processedstore.LayoutPartitioned, Horizon: 2 * time.Hour})
	require.NoError(t, err)
	require.NoError(t, plain.Migrate(ctx, sqldb.Pgx(pool)))
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	id := uuid.Must(uuid.NewV7())
	ok, err := plain.Claim(ctx, sqldb.Pgx(tx), "c", id)
	require.NoError(t, err)
	require.True(t, ok)
	err = part.MigrateToPartitioned(ctx, sqldb.Pgx(pool))
	require.Error(t, err)
	var kind string
	require.NoError(t, pool.QueryRow(ctx, `SELECT relkind::text FROM pg_class WHERE oid = 'processed_event'::regclass`).Scan(&kind))
	require.Equal(t, "r", kind, "nothing changed")
	require.NoError(t, tx.Commit(ctx))
	require.NoError(t, part.MigrateToPartitioned(ctx, sqldb.Pgx(pool)))
	ok, err = claimTx(t, pool, part, "c", id)
	require.NoError(t, err)
	require.False(t, ok, "the claim committed before the switch is found")
	if errors.Is(err, processedstore.ErrExpired) {
		t.Fatal("unexpected")
	}
}

// A UUIDv7 row the lean claim wrote without event_at (migration 7) is
// moved by the upgrade to the partitioned layout, whose event_at is NOT
// NULL, dated by its id: its next claim is a duplicate, not an error. The
// trigger before this test inserted its NULL event_at (SQLSTATE 23502).
func TestMigrateToPartitionedMovesLeanRowsDatedByTheirId(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	plain, err := processedstore.NewStore(processedstore.Config{Horizon: 2 * time.Hour})
	require.NoError(t, err)
	part, err := processedstore.NewStore(processedstore.Config{Layout: processedstore.LayoutPartitioned, Horizon: 2 * time.Hour})
	require.NoError(t, err)
	require.NoError(t, plain.Migrate(ctx, sqldb.Pgx(pool)))
	id := uuid.Must(uuid.NewV7())
	p, ok := plain.ClaimParamsAt("c", id, time.Time{}, nil)
	require.True(t, ok)
	tag, err := pool.Exec(ctx, p.SQL, p.Consumer, p.EventID, p.EventAt)
	require.NoError(t, err)
	require.EqualValues(t, 1, tag.RowsAffected())
	var null bool
	require.NoError(t, pool.QueryRow(ctx, `SELECT event_at IS NULL FROM processed_event WHERE event_id = $1`, id).Scan(&null))
	require.True(t, null, "the lean claim writes a UUIDv7 row without event_at")

	require.NoError(t, part.MigrateToPartitioned(ctx, sqldb.Pgx(pool)))
	ok, err = claimTx(t, pool, part, "c", id)
	require.NoError(t, err)
	require.False(t, ok, "the lean row is a duplicate after the switch")
	var at time.Time
	require.NoError(t, pool.QueryRow(ctx, `SELECT event_at FROM processed_event WHERE event_id = $1`, id).Scan(&at))
	want, _ := processedstore.EventTime(id, time.Time{})
	require.True(t, want.Equal(at), "moved row dated by its id: %s, want %s", at, want)
}
