package outbox_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/outbox"
)

// Behind PgBouncer in transaction pooling (Debian's 1.18; 1.24 with
// max_prepared_statements 0 and 200), a relay on a pgx pool in each of
// pgx's exec modes relays the rows producers write through the pooler (in
// the same mode, or in QueryExecModeExec where the producers' own
// statements need it), and the outbox's other calls (Pending, DeadLetters, Redrive,
// Replay on the pool) run there too: every producer transaction commits,
// every row is published exactly once, no relay round or housekeeping step
// fails, and the outbox is empty at the end. The exec modes of one pooler
// share its server connections, as services do.
func TestRelayBehindATransactionPoolerPublishesEachRowOnceInEveryExecMode(t *testing.T) {
	t.Parallel()
	testenv.EachPoolerExecMode(t, testenv.TransactionPoolers, nil,
		func(t *testing.T, bouncer *testenv.PgBouncer, setup testenv.PoolerSetup, mode pgx.QueryExecMode) {
			// The producers' own statements need a mode without named
			// statements behind a pooler that does not track them (pgx's
			// advice): the insert runs in it.
			producers := mode
			if mode == pgx.QueryExecModeCacheStatement && !setup.TracksPrepared {
				producers = pgx.QueryExecModeExec
			}
			relayBehindPooler(t, bouncer, mode, producers)
		})
}

// relayBehindPooler writes rows through bouncer on a pool in producers'
// mode while a relay relays them through it on a pool in mode, and checks
// the outcome (see the test above).
func relayBehindPooler(t *testing.T, bouncer *testenv.PgBouncer, mode, producers pgx.QueryExecMode) {
	const (
		writers   = 3
		perWriter = 20
		rows      = writers * perWriter
	)
	ctx := context.Background()
	// PgBouncer forwards no search_path: the table is schema-qualified.
	schema := testenv.Schema(t)
	table := schema + ".ob"
	admin := testenv.PoolOn(t, schema, 2)
	direct, err := outbox.New(outbox.Config{Table: table, DB: idempotency.Pgx(admin)}, nil)
	require.NoError(t, err)
	require.NoError(t, direct.Migrate(ctx))

	pool := bouncer.PoolBehind(t, mode, 4)
	logger := newTestLogger()
	ob, err := outbox.New(outbox.Config{Table: table, DB: idempotency.Pgx(pool)}, logger)
	require.NoError(t, err)
	producerPool := pool
	if producers != mode {
		producerPool = bouncer.PoolBehind(t, producers, 3)
	}
	s := &sink{}
	rec := &counts{}
	r, err := ob.NewRelay(s, outbox.RelayConfig{
		BatchSize: 7, PollInterval: 2 * time.Millisecond, StatsInterval: 10 * time.Millisecond,
		Retention: time.Hour, Recorder: rec,
	})
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	closed := false
	t.Cleanup(func() {
		if !closed {
			_ = r.Close()
			<-done
		}
	})

	// The producers, each row in a transaction of its own, while the
	// relay runs.
	var wg sync.WaitGroup
	var mu sync.Mutex
	var failed []error
	ids := make(chan string, rows)
	for w := 0; w < writers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < perWriter; i++ {
				id := newID()
				err := pgx.BeginFunc(ctx, producerPool, func(tx pgx.Tx) error {
					pub, err := ob.PgxPublisher(tx)
					if err != nil {
						return err
					}
					return pub.Publish("events", msg(id))
				})
				if err != nil {
					mu.Lock()
					failed = append(failed, err)
					mu.Unlock()
					continue
				}
				ids <- id
			}
		}()
	}
	wg.Wait()
	close(ids)
	written := map[string]bool{}
	for id := range ids {
		written[id] = true
	}

	left := func() int {
		var n int
		require.NoError(t, admin.QueryRow(ctx, `SELECT count(*) FROM `+table).Scan(&n))
		return n
	}
	eventually(t, 60*time.Second, func() bool { return left() == 0 }, "the outbox relayed")
	// Housekeeping (stats, archive purge) after the last row, twice.
	reports := rec.reports.Load()
	eventually(t, 60*time.Second, func() bool { return rec.reports.Load() >= reports+2 }, "housekeeping ran")
	closed = true
	require.NoError(t, r.Close())
	require.NoError(t, <-done)

	published := map[string]int{}
	for _, g := range s.all() {
		published[g.uuid]++
	}
	twice, missing := 0, 0
	for id := range written {
		switch n := published[id]; {
		case n == 0:
			missing++
		case n > 1:
			twice++
		}
	}
	var errs []string
	for _, e := range logger.Captured()[watermill.ErrorLogLevel] {
		errs = append(errs, fmt.Sprintf("%s: %v", e.Msg, e.Err))
	}
	t.Logf("written %d, producer failures %d, published twice %d, errors logged %d", len(written), len(failed), twice, len(errs))
	require.Empty(t, failed, "producer transactions that failed through the pooler")
	require.Zero(t, twice, "rows published more than once (of %d)", len(written))
	require.Zero(t, missing, "rows never published")
	require.Len(t, published, len(written), "rows published")
	require.Len(t, written, rows, "rows written")
	require.Empty(t, errs, "relay errors logged")
	require.Zero(t, rec.failed.Load(), "failed publishes")
	require.Zero(t, rec.dead.Load(), "rows dead-lettered")

	// The outbox's other calls through the pooler.
	pending, err := ob.Pending(ctx)
	require.NoError(t, err)
	require.Zero(t, pending)
	dead, err := ob.DeadLetters(ctx)
	require.NoError(t, err)
	require.Zero(t, dead)
	moved, err := ob.Redrive(ctx, outbox.RedriveFilter{All: true})
	require.NoError(t, err)
	require.Zero(t, moved)
	archived, err := ob.Replay(ctx, wsql.BeginnerFromPgx(pool), nil, outbox.ReplayFilter{
		From: time.Now().Add(-time.Hour), To: time.Now().Add(time.Hour), DryRun: true})
	require.NoError(t, err)
	require.Equal(t, len(written), archived, "rows in the archive")
}
