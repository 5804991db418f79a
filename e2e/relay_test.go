package e2e_test

import (
	"context"
	"errors"
	"net/url"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/examples/order"
	"github.com/watermill-idempotency/idempotency/examples/shop"
	"github.com/watermill-idempotency/idempotency/examples/stock"
	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/outbox"
	"github.com/watermill-idempotency/idempotency/processed"
)

// producer is the order service on a schema of its own.
type producer struct {
	pool   *pgxpool.Pool
	schema string
	svc    *order.Service
}

func newProducer(t *testing.T) *producer {
	t.Helper()
	schema := testenv.Schema(t)
	pool := testenv.PoolOn(t, schema, 8)
	svc, err := order.New(order.Config{Pool: pool})
	require.NoError(t, err)
	require.NoError(t, svc.Migrate(context.Background()))
	return &producer{pool: pool, schema: schema, svc: svc}
}

// write commits one outbox row per id, each in its own transaction.
func (p *producer) write(t *testing.T, ids ...string) {
	t.Helper()
	for _, id := range ids {
		tx, err := p.pool.Begin(context.Background())
		require.NoError(t, err)
		p.publishIn(t, tx, id)
		require.NoError(t, tx.Commit(context.Background()))
	}
}

func (p *producer) publishIn(t *testing.T, tx pgx.Tx, id string) {
	t.Helper()
	msg, err := marshaler.NewMessageWithID(uuid.MustParse(id), shop.EventOrderPlaced, time.Now().UTC(), placedPayload)
	require.NoError(t, err)
	require.NoError(t, p.svc.PublishInTx(context.Background(), tx, shop.EventOrderPlaced, msg))
}

func (p *producer) pending(t *testing.T) int {
	t.Helper()
	n, err := p.svc.Pending(context.Background())
	require.NoError(t, err)
	return n
}

// rounds counts the relay's rounds (outbox.Recorder).
type rounds struct{ n atomic.Int64 }

func (r *rounds) Round(int)                  { r.n.Add(1) }
func (r *rounds) PublishFailed(string)       {}
func (r *rounds) DeadLettered(string)        {}
func (r *rounds) Pending(int, time.Duration) {}

// loseConfirms reports a failure after the broker took the message, for
// the first lose publishes: a relay whose confirm was lost publishes the
// row again, with the same event_id.
type loseConfirms struct {
	message.Publisher
	lose atomic.Int64
}

func (l *loseConfirms) Publish(topic string, msgs ...*message.Message) error {
	if err := l.Publisher.Publish(topic, msgs...); err != nil {
		return err
	}
	if l.lose.Add(-1) >= 0 {
		return errors.New("confirm lost")
	}
	return nil
}

// startRelay runs a relay of p to dest (e's exchange when nil) until the
// test ends.
func (e *env) startRelay(p *producer, rec outbox.Recorder, dest message.Publisher, batch int) *order.Relay {
	e.t.Helper()
	if dest == nil {
		dest = e.publisher()
	}
	relay, err := order.NewRelay(order.RelayConfig{
		Pool:          p.pool,
		Publisher:     dest,
		BatchSize:     batch,
		PollInterval:  10 * time.Millisecond,
		RetryInterval: 10 * time.Millisecond,
		Recorder:      rec,
		Logger:        watermill.NopLogger{},
	})
	require.NoError(e.t, err)
	done := make(chan error, 1)
	go func() { done <- relay.Run(context.Background()) }()
	e.t.Cleanup(func() {
		_ = relay.Close()
		<-done
	})
	select {
	case <-relay.Running():
	case err := <-done:
		e.t.Fatalf("relay stopped: %v", err)
	case <-time.After(15 * time.Second):
		e.t.Fatal("relay did not start")
	}
	return relay
}

// TestRelayNeverSkipsLosesOrForksIDs (C13) — the outbox relay must not skip, lose or fork ids.
func TestRelayNeverSkipsLosesOrForksIDs(t *testing.T) {
	t.Parallel()

	// Base: tx A writes E1 and stays open; tx B writes E2 and commits; the
	// relay runs and publishes E2 while A is open (it claims committed rows;
	// no position moves past E1); A commits; the relay runs twice more and
	// E1 arrives: never skipped, each once.
	t.Run("base", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t, testConsumer)
		p := newProducer(t)
		pr := &probe{}
		e.startConsumer(consumerOpts{middleware: []message.HandlerMiddleware{pr.middleware}})
		ctx := context.Background()
		txA, err := p.pool.Begin(ctx)
		require.NoError(t, err)
		p.publishIn(t, txA, E1)
		p.write(t, E2)

		rec := &rounds{}
		e.startRelay(p, rec, nil, 0)
		eventually(t, 15*time.Second, "E2 arrives while tx A is open", func(o *testenv.Observed) bool { return o.Int("effects(E2)", e.effects(E2)) == 1 })
		require.Equal(t, 0, e.effects(E1), "E1 is not committed yet")
		require.NoError(t, txA.Commit(ctx))

		eventually(t, 15*time.Second, "E1 and E2 both arrive", func(o *testenv.Observed) bool {
			return o.Int("effects(E1)", e.effects(E1)) == 1 && o.Int("effects(E2)", e.effects(E2)) == 1
		})
		n := rec.n.Load()
		eventually(t, 10*time.Second, "the relay runs twice more", func(o *testenv.Observed) bool { return testenv.See(o, "rounds", rec.n.Load()) >= n+2 })
		require.Equal(t, 0, p.pending(t))
		require.Len(t, pr.of(E1), 1)
		require.Len(t, pr.of(E2), 1)
		require.Equal(t, 1, e.processed(E1))
		require.Equal(t, 1, e.processed(E2))
	})

	// V: the broker confirms E1, then the relay is killed (SIGKILL, child
	// process, crash point outbox-after-publish) before it deletes the row;
	// the restarted relay publishes
	// E1 again, same event_id, and the consumer's claim absorbs it.
	t.Run("V", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t, testConsumer)
		p := newProducer(t)
		pr, rec := &probe{}, &recorder{}
		e.startConsumer(consumerOpts{middleware: []message.HandlerMiddleware{pr.middleware}, recorder: rec})
		p.write(t, E1)
		spawn(t, "relay", "E2E_SCHEMA="+p.schema, "E2E_PREFIX="+e.topo.Prefix)
		eventually(t, 15*time.Second, "the killed relay's publish processed", func(o *testenv.Observed) bool { return o.Int("effects(E1)", e.effects(E1)) == 1 })
		require.Equal(t, 1, p.pending(t), "the row was not deleted")

		e.startRelay(p, nil, nil, 0)
		eventually(t, 15*time.Second, "E1 republished", func(o *testenv.Observed) bool {
			return o.Int("deliveries(E1)", len(pr.of(E1))) == 2 && o.Int("pending", p.pending(t)) == 0
		})
		require.Equal(t, 1, rec.Count(inbox.OutcomeDuplicate))
		require.Equal(t, 1, e.calls(E1))
		require.Equal(t, 1, e.processed(E1))
		require.Equal(t, 1, e.effects(E1))
	})

	// M: two relay instances drain 100 rows: 100 distinct event_ids reach
	// the consumer, 100 effects.
	t.Run("M", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t, testConsumer)
		p := newProducer(t)
		pr := &probe{}
		e.startConsumer(consumerOpts{middleware: []message.HandlerMiddleware{pr.middleware}})
		ids := make([]string, 100)
		want := map[string]bool{}
		for i := range ids {
			ids[i] = uuid.Must(uuid.NewV7()).String()
			want[ids[i]] = true
		}
		p.write(t, ids...)
		var wg sync.WaitGroup
		for i := 0; i < 2; i++ {
			wg.Add(1)
			go func() { defer wg.Done(); e.startRelay(p, nil, nil, 10) }()
		}
		wg.Wait()
		eventually(t, 30*time.Second, "100 events processed", func(o *testenv.Observed) bool {
			return o.Int("processed_event rows", e.count(`SELECT count(*) FROM (`+claimsSQL+`) x`)) == 100 && o.Int("pending", p.pending(t)) == 0
		})
		require.Equal(t, 100, e.count(`SELECT count(*) FROM effect`))
		require.Equal(t, 100, e.count(`SELECT count(DISTINCT event_id) FROM effect`))
		for _, d := range pr.deliveries() {
			require.True(t, want[d.uuid], "unknown event id %s reached the consumer", d.uuid)
		}
	})
}

// The relay publishes an order's event twice (the broker's confirm was lost
// after the publish), and an operator replays the range later: the stock
// consumer reserves the order's lines once.
func TestRelayDuplicateThenReplay(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, stock.Consumer)
	require.NoError(t, stock.Migrate(ctx, e.pool, processed.Config{}))
	p := newProducer(t)
	rec := &recorder{}
	var calls atomic.Int32
	e.startConsumer(consumerOpts{
		handler: func(msg *message.Message) error {
			calls.Add(1)
			return stock.Handle(msg)
		},
		recorder: rec,
	})
	from := time.Now().Add(-time.Second)
	evID, err := p.svc.PlaceOrder(ctx, "o-1", []shop.OrderLine{{SKU: "sku-1", Quantity: "2.000"}, {SKU: "sku-2", Quantity: "0.250"}})
	require.NoError(t, err)

	lose := &loseConfirms{Publisher: e.publisher()}
	lose.lose.Store(1)
	e.startRelay(p, nil, lose, 0)
	eventually(t, 15*time.Second, "the relay republished the event", func(o *testenv.Observed) bool {
		return o.Int("duplicates", rec.Count(inbox.OutcomeDuplicate)) == 1 && o.Int("pending", p.pending(t)) == 0
	})

	pub := e.publisher()
	n, err := p.svc.Replay(ctx, pub, from, time.Now().Add(time.Second))
	require.NoError(t, err)
	require.Equal(t, 1, n)
	eventually(t, 15*time.Second, "the replay to be a duplicate too", func(o *testenv.Observed) bool {
		return o.Int("duplicates", rec.Count(inbox.OutcomeDuplicate)) == 2
	})

	require.EqualValues(t, 1, calls.Load())
	require.Equal(t, 1, e.processed(evID))
	require.Equal(t, 2, e.count(`SELECT count(*) FROM reservation WHERE event_id = $1`, evID))
	var q1, q2, total string
	require.NoError(t, e.pool.QueryRow(ctx, `SELECT
		(SELECT quantity::text FROM reservation WHERE line_no = 1),
		(SELECT quantity::text FROM reservation WHERE line_no = 2),
		(SELECT sum(reserved)::text FROM stock_level)`).Scan(&q1, &q2, &total))
	require.Equal(t, []string{"2.000", "0.250", "2.250"}, []string{q1, q2, total})
	require.Equal(t, 0, e.ready(e.topo.DeadLetterQueue(e.consumer)))
}

// TestRelayBehindATransactionOpenElsewhere (N07) — the outbox relay behind a transaction that stays open elsewhere.
// Session S runs BEGIN; SELECT pg_current_xact_id(); and stays open, in
// another database of the server (S1) and in the producer's own database
// with its own outbox row (S2). Meanwhile the producer commits one order: it
// reaches the consumer while both are still open (the relay's normal
// latency, not S's lifetime), and S2's row, committed later, is not skipped.
func TestRelayBehindATransactionOpenElsewhere(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, testConsumer)
	p := newProducer(t)
	e.startConsumer(consumerOpts{})
	e.startRelay(p, nil, nil, 0)

	u, err := url.Parse(testenv.PostgresURL())
	require.NoError(t, err)
	u.Path = "/postgres"
	other, err := pgx.Connect(ctx, u.String())
	require.NoError(t, err)
	defer other.Close(ctx)
	s1, err := other.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = s1.Rollback(ctx) }()
	var xid string
	require.NoError(t, s1.QueryRow(ctx, `SELECT pg_current_xact_id()::text`).Scan(&xid))

	s2, err := p.pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = s2.Rollback(ctx) }()
	require.NoError(t, s2.QueryRow(ctx, `SELECT pg_current_xact_id()::text`).Scan(&xid))
	p.publishIn(t, s2, E2)

	start := time.Now()
	p.write(t, E1)
	eventually(t, 8*time.Second, "E1 applied while S1 and S2 are open", func(o *testenv.Observed) bool { return o.Int("effects(E1)", e.effects(E1)) == 1 })
	t.Logf("E1 applied %s after its commit, S1 and S2 open", time.Since(start))
	require.Equal(t, 0, e.effects(E2))
	require.NoError(t, s2.Commit(ctx))
	eventually(t, 15*time.Second, "S2's own row, committed later, is relayed", func(o *testenv.Observed) bool { return o.Int("effects(E2)", e.effects(E2)) == 1 })
	eventually(t, 10*time.Second, "nothing pending", func(o *testenv.Observed) bool { return o.Int("pending", p.pending(t)) == 0 })
}
