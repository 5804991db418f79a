package inbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/crashpoint"
	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/outbox"
)

// collect subscribes to topic and gathers what arrives, acking each.
type collected struct {
	mu   sync.Mutex
	msgs []*message.Message
}

func collect(t *testing.T, sub message.Subscriber, topic string) *collected {
	t.Helper()
	ch, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	c := &collected{}
	go func() {
		for m := range ch {
			c.mu.Lock()
			c.msgs = append(c.msgs, m)
			c.mu.Unlock()
			m.Ack()
		}
	}()
	return c
}

func (c *collected) names() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []string
	for _, m := range c.msgs {
		out = append(out, marshaler.EventName(m))
	}
	return out
}

func (c *collected) len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.msgs)
}

// TestFailedAttempt_ProducedMessagesDiscarded (issue 11 A.1): through the
// recommended chain on a real router, a handler that produces messages and
// then fails (ordinary error poisoned after the retries, permanent error,
// panic) gets none of them published: not by the router (PoisonQueue turns
// the error into nil, and the router publishes what the chain returned),
// not through the outbox, not through PublisherFromContext.
func TestFailedAttempt_ProducedMessagesDiscarded(t *testing.T) {
	t.Parallel()
	for _, withOutbox := range []bool{false, true} {
		t.Run(fmt.Sprintf("outbox=%v", withOutbox), func(t *testing.T) {
			t.Parallel()
			e, ob := newOutboxEnv(t)
			logger := watermill.NopLogger{}
			pubsub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16}, logger)
			defer pubsub.Close()
			out := collect(t, pubsub, "out")
			poison := collect(t, pubsub, "poison")

			cfg := inbox.Config{
				Beginner: mustBeginner(inbox.NewPgxBeginner(e.pool, inbox.PgxBeginnerConfig{})),
				Store:    e.store, Consumer: "stock",
			}
			if withOutbox {
				cfg.Outbox, cfg.OutboxTopic = ob, "out"
			}
			idem, err := inbox.NewIdempotent(cfg, logger)
			require.NoError(t, err)
			chain, err := inbox.NewChain(inbox.ChainConfig{
				Idempotent: idem, PoisonPublisher: pubsub, PoisonTopic: "poison",
				MaxRetries: 2, InitialInterval: time.Millisecond, MaxInterval: time.Millisecond,
			}, logger)
			require.NoError(t, err)
			router, err := message.NewRouter(message.RouterConfig{}, logger)
			require.NoError(t, err)
			h := router.AddHandler("stock", "in", pubsub, "out", pubsub, func(msg *message.Message) ([]*message.Message, error) {
				kind := msg.Metadata.Get("kind")
				ret, err := marshaler.NewMessage("returned."+kind, map[string]string{"e": msg.UUID})
				require.NoError(t, err)
				if pub, ok := inbox.PublisherFromContext(msg.Context()); ok {
					side, err := marshaler.NewMessage("context."+kind, map[string]string{"e": msg.UUID})
					require.NoError(t, err)
					require.NoError(t, pub.Publish("out", side))
				}
				if err := writeEffect(msg, kind); err != nil {
					return nil, err
				}
				switch kind {
				case "error":
					return []*message.Message{ret}, errors.New("handler failed after producing")
				case "permanent":
					return []*message.Message{ret}, inbox.Permanent(errors.New("refused after producing"))
				case "panic":
					panic("handler panicked after producing")
				}
				return []*message.Message{ret}, nil // "ok": the sentinel
			})
			for _, m := range chain {
				h.AddMiddleware(m)
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			go func() { _ = router.Run(ctx) }()
			<-router.Running()
			defer router.Close()

			kinds := []string{"error", "permanent", "panic", "ok"}
			for _, kind := range kinds {
				m, err := marshaler.NewMessage("order.placed", map[string]string{"kind": kind})
				require.NoError(t, err)
				m.Metadata.Set("kind", kind)
				require.NoError(t, pubsub.Publish("in", m))
			}
			// GoChannel hands the handler one message at a time: once the
			// sentinel's product exists, the failed ones were settled.
			if withOutbox {
				waitUntil(t, "the sentinel's 2 outbox rows", func() bool { return e.outboxRows() >= 2 },
					func() string { return fmt.Sprintf("%d outbox rows", e.outboxRows()) })
				require.Equal(t, 2, e.outboxRows(), "only the sentinel's two messages are in the outbox")
			} else {
				waitUntil(t, "the sentinel's message on the out topic", func() bool { return out.len() >= 1 },
					func() string { return fmt.Sprintf("out topic: %v", out.names()) })
			}
			waitUntil(t, "3 poisoned messages", func() bool { return poison.len() == 3 },
				func() string { return fmt.Sprintf("poisoned: %v", poison.names()) })
			require.NoError(t, router.Close())
			if withOutbox {
				require.Empty(t, out.names(), "with an outbox the router publishes nothing")
			} else {
				require.Equal(t, []string{"returned.ok"}, out.names(), "a failed attempt's messages never reach the router's publisher")
			}
			require.Equal(t, 1, e.count(`SELECT count(*) FROM effect`), "only the sentinel's effect")
			require.Equal(t, 1, e.count(`SELECT count(*) FROM processed_event`))
		})
	}
}

// panickingOutbox returns an outbox publisher decorator (user code, as an
// instrumentation would be) whose Publish panics while armed counts down
// above zero: a failure inside the outbox write, after the handler returned.
func panickingOutbox(armed *atomic.Int32) message.PublisherDecorator {
	return func(pub message.Publisher) (message.Publisher, error) {
		return panickingPublisher{Publisher: pub, armed: armed}, nil
	}
}

type panickingPublisher struct {
	message.Publisher
	armed *atomic.Int32 // panics while > 0, counting down
}

func (p panickingPublisher) Publish(topic string, msgs ...*message.Message) error {
	if p.armed.Add(-1) >= 0 {
		panic("outbox publisher decorator panicked")
	}
	return p.Publisher.Publish(topic, msgs...)
}

// beginnerUnderTest is one of the beginners on its own handles, whose
// application_name is the test's schema so that the server's view of its
// sessions can be read.
type beginnerUnderTest struct {
	name     string
	beginner inbox.TxBeginner
	inUse    func() int
}

func beginnersUnderTest(t *testing.T, schema string) []beginnerUnderTest {
	t.Helper()
	mkPool := func() *pgxpool.Pool {
		cfg := testenv.PoolConfig(t, testenv.PostgresURL(), schema, 4)
		cfg.ConnConfig.RuntimeParams["application_name"] = schema
		pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
		require.NoError(t, err)
		t.Cleanup(func() { closeBounded(t, pool.Close) })
		return pool
	}
	pipelined, unpipelined := mkPool(), mkPool()
	db, err := sql.Open("pgx", testenv.SchemaURL(schema)+"&application_name="+schema)
	require.NoError(t, err)
	db.SetMaxOpenConns(4)
	t.Cleanup(func() { closeBounded(t, func() { _ = db.Close() }) })
	return []beginnerUnderTest{
		{"pgx-pipelined", mustBeginner(inbox.NewPgxBeginner(pipelined, inbox.PgxBeginnerConfig{})),
			func() int { return int(pipelined.Stat().AcquiredConns()) }},
		{"pgx-unpipelined", mustBeginner(inbox.NewPgxBeginner(unpipelined, inbox.PgxBeginnerConfig{DisablePipeline: true})),
			func() int { return int(unpipelined.Stat().AcquiredConns()) }},
		{"database-sql", mustBeginner(inbox.NewStdBeginner(db)),
			func() int { return db.Stats().InUse }},
	}
}

// closeBounded closes a handle whose Close waits for acquired connections
// (pgxpool): a leaked connection fails the test instead of hanging it.
func closeBounded(t *testing.T, closeFn func()) {
	done := make(chan struct{})
	go func() { closeFn(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Error("Close blocked for 5 s: a connection is still acquired")
	}
}

// idleInTx counts the server's sessions of this test left inside a
// transaction.
func (e *env) idleInTx() int {
	return e.count(`SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND state LIKE 'idle in transaction%'`, e.schema)
}

// callRecovering runs one attempt, bounded to 5 s (a leaked connection must
// fail the test, not hang it), and returns the panic it raised, if any.
func callRecovering(h message.HandlerFunc, msg *message.Message) (panicked any, err error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	msg.SetContext(ctx)
	defer func() { panicked = recover() }()
	_, err = h(msg)
	return nil, err
}

// writeEffectQ is writeEffect through the driver-neutral querier.
func writeEffectQ(msg *message.Message, note string) error {
	q, ok := inbox.QuerierFromContext(msg.Context())
	if !ok {
		return errors.New("no querier in context")
	}
	_, err := q.Exec(msg.Context(), `INSERT INTO effect (event_id, note) VALUES ($1, $2)`, msg.UUID, note)
	return err
}

// TestFailedAttempt_PanicReleasesConnection (issue 11 A.2): a panic after the
// claim, in the handler or in the outbox write (a SchemaAdapter), rolls back
// and releases the connection for every beginner: after three panicking
// attempts no connection is acquired, no session of the test is idle in a
// transaction, and the next delivery of the same event is processed (not
// "in flight": the claim's row lock is gone).
func TestFailedAttempt_PanicReleasesConnection(t *testing.T) {
	t.Parallel()
	e, _ := newOutboxEnv(t)
	for _, where := range []string{"handler", "schema-adapter"} {
		for _, b := range beginnersUnderTest(t, e.schema) {
			t.Run(where+"/"+b.name, func(t *testing.T) {
				armed := &atomic.Int32{}
				ob, err := outbox.New(outbox.Config{DB: idempotency.Pgx(e.pool), PublisherDecorators: []message.PublisherDecorator{panickingOutbox(armed)}}, nil)
				require.NoError(t, err)
				idem, err := inbox.NewIdempotent(inbox.Config{
					Beginner: b.beginner, Store: e.store, Consumer: "panic-" + where + "-" + b.name,
					Outbox: ob, OutboxTopic: "out", LockTimeout: 200 * time.Millisecond,
				}, nil)
				require.NoError(t, err)
				var panicking atomic.Bool
				panicking.Store(true)
				h := idem.Middleware(func(msg *message.Message) ([]*message.Message, error) {
					if err := writeEffectQ(msg, where+"/"+b.name); err != nil {
						return nil, err
					}
					if where == "handler" && panicking.Load() {
						panic("handler panicked")
					}
					out, err := marshaler.NewMessage("email.requested", map[string]string{"e": msg.UUID})
					return []*message.Message{out}, err
				})
				id := newID()
				const attempts = 3
				if where == "schema-adapter" {
					armed.Store(attempts)
				}
				for i := 0; i < attempts; i++ {
					p, err := callRecovering(h, newMsg(id))
					require.NoError(t, err)
					require.NotNil(t, p, "attempt %d must re-raise the panic", i+1)
				}
				require.Zero(t, b.inUse(), "no connection stays acquired after panics")
				require.Zero(t, e.idleInTx(), "no session stays idle in transaction")
				panicking.Store(false)
				p, err := callRecovering(h, newMsg(id))
				require.Nil(t, p)
				require.NoError(t, err, "the next delivery is processed, not in flight")
				require.Equal(t, 1, e.effects(id))
				require.Equal(t, 1, e.processed(id))
				require.Zero(t, b.inUse())
			})
		}
	}
}

// TestFailedAttempt_PanicOnCommitPathReleasesConnection (issue 11 A.2): a
// panic after the outbox write, on the way to COMMIT, rolls back and
// releases too. Not parallel: it sets the process-wide crash-point hook, and
// Go runs it before the package's parallel tests start.
func TestFailedAttempt_PanicOnCommitPathReleasesConnection(t *testing.T) {
	e, ob := newOutboxEnv(t)
	var armed atomic.Bool
	crashpoint.Set(func(name string) {
		if name == crashpoint.BeforeCommit && armed.Load() {
			panic("panic on the commit path")
		}
	})
	t.Cleanup(func() { crashpoint.Set(nil) })
	for _, b := range beginnersUnderTest(t, e.schema) {
		t.Run(b.name, func(t *testing.T) {
			idem, err := inbox.NewIdempotent(inbox.Config{
				Beginner: b.beginner, Store: e.store, Consumer: "commit-" + b.name,
				Outbox: ob, OutboxTopic: "out", LockTimeout: 200 * time.Millisecond,
			}, nil)
			require.NoError(t, err)
			h := idem.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				if err := writeEffectQ(msg, b.name); err != nil {
					return nil, err
				}
				out, err := marshaler.NewMessage("email.requested", map[string]string{"e": msg.UUID})
				return []*message.Message{out}, err
			})
			id := newID()
			armed.Store(true)
			for i := 0; i < 3; i++ {
				p, err := callRecovering(h, newMsg(id))
				require.NoError(t, err)
				require.NotNil(t, p)
			}
			armed.Store(false)
			require.Zero(t, b.inUse(), "no connection stays acquired")
			require.Zero(t, e.idleInTx(), "no session stays idle in transaction")
			require.Zero(t, e.effects(id))
			p, err := callRecovering(h, newMsg(id))
			require.Nil(t, p)
			require.NoError(t, err, "the next delivery is processed, not in flight")
			require.Equal(t, 1, e.effects(id))
		})
	}
	require.Equal(t, 3, e.outboxRows(), "one outbox row per beginner, from the successful attempt only")
}

// waitUntil polls cond every 10 ms for up to 60 s (see sqlSubscriberRig for
// why so long); on timeout it fails saying what it waited for and what it saw.
func waitUntil(t *testing.T, what string, cond func() bool, saw func() string) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("waited 60 s for %s; saw %s", what, saw())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func newID() string {
	m, err := marshaler.NewMessage("x", struct{}{})
	if err != nil {
		panic(err)
	}
	return m.UUID
}

// sqlSubscriberRig runs the idempotent middleware behind the real
// watermill-sql v4 subscriber on PostgreSQL (one batch, one transaction).
// Its DefaultPostgreSQLSchema reads only rows below the server's oldest open
// transaction, so another session's long transaction delays (never breaks)
// these tests: their waits are bounded generously (60 s) for that.
type sqlSubscriberRig struct {
	e     *env
	sub   *wsql.Subscriber
	pub   *wsql.Publisher
	topic string
}

func newSQLSubscriberRig(t *testing.T) *sqlSubscriberRig {
	t.Helper()
	e, _ := newOutboxEnv(t)
	logger := watermill.NopLogger{}
	sub, err := wsql.NewSubscriber(wsql.BeginnerFromPgx(e.pool), wsql.SubscriberConfig{
		SchemaAdapter: wsql.DefaultPostgreSQLSchema{}, OffsetsAdapter: wsql.DefaultPostgreSQLOffsetsAdapter{},
		InitializeSchema: true, PollInterval: 20 * time.Millisecond, ResendInterval: 5 * time.Millisecond,
	}, logger)
	require.NoError(t, err)
	topic := "orders"
	require.NoError(t, sub.SubscribeInitialize(topic))
	pub, err := wsql.NewPublisher(wsql.BeginnerFromPgx(e.pool), wsql.PublisherConfig{SchemaAdapter: wsql.DefaultPostgreSQLSchema{}}, logger)
	require.NoError(t, err)
	return &sqlSubscriberRig{e: e, sub: sub, pub: pub, topic: topic}
}

func (r *sqlSubscriberRig) publishBatch(t *testing.T, n int) []string {
	t.Helper()
	var ids []string
	var batch []*message.Message
	for i := 0; i < n; i++ {
		m, err := marshaler.NewMessage("order.placed", map[string]int{"i": i})
		require.NoError(t, err)
		ids = append(ids, m.UUID)
		batch = append(batch, m)
	}
	require.NoError(t, r.pub.Publish(r.topic, batch...))
	return ids
}

func (r *sqlSubscriberRig) run(t *testing.T, router *message.Router) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	go func() { _ = router.Run(ctx) }()
	<-router.Running()
	t.Cleanup(func() { _ = router.Close() })
}

// TestFailedAttempt_SavepointJoinPanicNeverAcksUnapplied (issue 11 A.2): on
// the SQL-subscriber savepoint join, a panic in the outbox write (after the
// handler returned) rolls back to the message's savepoint, so the redelivery
// in the same subscriber transaction is processed again: the claim is never
// acked as a duplicate of an attempt whose outbox write did not happen.
func TestFailedAttempt_SavepointJoinPanicNeverAcksUnapplied(t *testing.T) {
	t.Parallel()
	r := newSQLSubscriberRig(t)
	logger := watermill.NopLogger{}
	armed := &atomic.Int32{}
	armed.Store(1)
	ob, err := outbox.New(outbox.Config{DB: idempotency.Pgx(r.e.pool), PublisherDecorators: []message.PublisherDecorator{panickingOutbox(armed)}}, nil)
	require.NoError(t, err)
	idem, err := inbox.NewIdempotent(inbox.Config{
		Beginner: inbox.NewSQLSubscriberBeginner(), Store: r.e.store, Consumer: "stock",
		Outbox: ob, OutboxTopic: "out",
	}, logger)
	require.NoError(t, err)
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	require.NoError(t, err)
	var calls atomic.Int32
	h := router.AddConsumerHandler("stock", r.topic, r.sub, func(msg *message.Message) error {
		calls.Add(1)
		if err := writeEffectQ(msg, "x"); err != nil {
			return err
		}
		out, err := marshaler.NewMessage("email.requested", map[string]string{"e": msg.UUID})
		if err != nil {
			return err
		}
		pub, _ := inbox.PublisherFromContext(msg.Context())
		return pub.Publish("out", out)
	})
	h.AddMiddleware(wmw.Recoverer, idem.Middleware)
	ids := r.publishBatch(t, 1)
	r.run(t, router)
	waitUntil(t, "the event's claim committed", func() bool { return r.e.processed(ids[0]) == 1 },
		func() string {
			return fmt.Sprintf("%d claims, %d outbox rows, %d handler calls", r.e.processed(ids[0]), r.e.outboxRows(), calls.Load())
		})
	require.NoError(t, router.Close())
	require.Equal(t, int32(2), calls.Load(), "the panicking attempt is redelivered and processed, not skipped as a duplicate")
	require.Equal(t, 1, r.e.outboxRows(), "the produced message is written once")
	require.Equal(t, 1, r.e.effects(ids[0]))
}

// TestFailedAttempt_SavepointJoinSwallowedSQLError (issue 11 A.3): in the
// SQL-subscriber savepoint join on PostgreSQL, a handler that swallows an SQL
// error (the transaction is aborted: RELEASE SAVEPOINT answers 25P02) costs
// only its own message: it is rolled back to its savepoint and poisoned once;
// the batch's other messages commit once each.
func TestFailedAttempt_SavepointJoinSwallowedSQLError(t *testing.T) {
	t.Parallel()
	r := newSQLSubscriberRig(t)
	logger := watermill.NopLogger{}
	poison := &capture{msgs: make(chan *message.Message, 16)}
	idem, err := inbox.NewIdempotent(inbox.Config{
		Beginner: inbox.NewSQLSubscriberBeginner(), Store: r.e.store, Consumer: "stock",
	}, logger)
	require.NoError(t, err)
	chain, err := inbox.NewChain(inbox.ChainConfig{
		Idempotent: idem, PoisonPublisher: poison, PoisonTopic: "poison",
		MaxRetries: 2, InitialInterval: time.Millisecond, MaxInterval: time.Millisecond,
	}, logger)
	require.NoError(t, err)
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	require.NoError(t, err)
	ids := r.publishBatch(t, 5)
	var mu sync.Mutex
	calls := map[string]int{}
	h := router.AddConsumerHandler("stock", r.topic, r.sub, func(msg *message.Message) error {
		mu.Lock()
		calls[msg.UUID]++
		mu.Unlock()
		if err := writeEffectQ(msg, "x"); err != nil {
			return err
		}
		if msg.UUID == ids[2] {
			q, _ := inbox.QuerierFromContext(msg.Context())
			_, _ = q.Exec(msg.Context(), `SELECT 1/0`) // swallowed: the transaction is now aborted
		}
		return nil
	})
	for _, m := range chain {
		h.AddMiddleware(m)
	}
	r.run(t, router)
	claims := func() int { return r.e.count(`SELECT count(*) FROM processed_event`) }
	waitUntil(t, "4 committed claims and 1 poisoned message", func() bool { return claims() == 4 && len(poison.msgs) == 1 },
		func() string {
			mu.Lock()
			defer mu.Unlock()
			return fmt.Sprintf("%d claims, %d poisoned, handler calls %v", claims(), len(poison.msgs), calls)
		})
	require.NoError(t, router.Close())
	p := <-poison.msgs
	require.Equal(t, ids[2], p.UUID)
	require.Contains(t, p.Metadata.Get(wmw.ReasonForPoisonedKey), "25P02")
	require.Zero(t, r.e.processed(ids[2]))
	require.Zero(t, r.e.effects(ids[2]), "the swallowing message's effects roll back to its savepoint")
	mu.Lock()
	defer mu.Unlock()
	for i, id := range ids {
		if i == 2 {
			require.Equal(t, 3, calls[id], "first attempt and two retries, then poisoned once")
			continue
		}
		require.Equal(t, 1, calls[id], "message %d is handled once", i)
		require.Equal(t, 1, r.e.effects(id), "message %d commits once", i)
		require.Equal(t, 1, r.e.processed(id))
	}
}

// TestFailedAttempt_SiblingSavepointsDistinct (issue 11 A.4): savepoints the
// handler opens with tx.Begin on the pipelined pgx.Tx get names of their own:
// with two siblings open, rolling back the first undoes the first's work (and,
// as SQL savepoints nest, everything after it), exactly as on pgx's own
// transaction type. With one name per depth, the first's rollback went back
// to the second's savepoint and kept the first's row.
func TestFailedAttempt_SiblingSavepointsDistinct(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	for _, disable := range []bool{false, true} {
		t.Run(fmt.Sprintf("DisablePipeline=%v", disable), func(t *testing.T) {
			t.Parallel()
			h := e.mw(e.pool, func(c *inbox.Config) {
				c.Beginner = mustBeginner(inbox.NewPgxBeginner(e.pool, inbox.PgxBeginnerConfig{DisablePipeline: disable}))
				c.Consumer = fmt.Sprint("sp-", disable)
			})(func(msg *message.Message) ([]*message.Message, error) {
				ctx := msg.Context()
				tx, _ := inbox.PgxTxFromContext(ctx)
				first, err := tx.Begin(ctx)
				if err != nil {
					return nil, err
				}
				if _, err := first.Exec(ctx, `INSERT INTO effect (event_id, note) VALUES ($1, 'first')`, msg.UUID); err != nil {
					return nil, err
				}
				second, err := tx.Begin(ctx)
				if err != nil {
					return nil, err
				}
				if _, err := second.Exec(ctx, `INSERT INTO effect (event_id, note) VALUES ($1, 'second')`, msg.UUID); err != nil {
					return nil, err
				}
				if err := first.Rollback(ctx); err != nil {
					return nil, err
				}
				// A third sibling after a released one.
				third, err := tx.Begin(ctx)
				if err != nil {
					return nil, err
				}
				if _, err := third.Exec(ctx, `INSERT INTO effect (event_id, note) VALUES ($1, 'third')`, msg.UUID); err != nil {
					return nil, err
				}
				if err := third.Commit(ctx); err != nil {
					return nil, err
				}
				fourth, err := tx.Begin(ctx)
				if err != nil {
					return nil, err
				}
				if _, err := fourth.Exec(ctx, `INSERT INTO effect (event_id, note) VALUES ($1, 'fourth')`, msg.UUID); err != nil {
					return nil, err
				}
				if err := fourth.Rollback(ctx); err != nil {
					return nil, err
				}
				return nil, nil
			})
			id := newID()
			_, err := h(newMsg(id))
			require.NoError(t, err)
			var notes []string
			rows, err := e.pool.Query(context.Background(), `SELECT note FROM effect WHERE event_id = $1 ORDER BY id`, id)
			require.NoError(t, err)
			for rows.Next() {
				var n string
				require.NoError(t, rows.Scan(&n))
				notes = append(notes, n)
			}
			require.NoError(t, rows.Err())
			require.Equal(t, []string{"third"}, notes, "rolling back the first sibling undoes it; the fourth's rollback keeps the third")
		})
	}
}

// TestFailedAttempt_InvalidProducedIsPermanent (issue 11 A.5): a produced
// message that could never be relayed as an envelope (no event_name, a UUID
// that is no event id, a payload that is not JSON) fails the attempt as
// permanent with reason "invalid_produced", whether it is returned (with or
// without an outbox) or published through PublisherFromContext (even when the
// handler ignores Publish's error); nothing commits.
func TestFailedAttempt_InvalidProducedIsPermanent(t *testing.T) {
	t.Parallel()
	e, ob := newOutboxEnv(t)
	bad := map[string]func() *message.Message{
		"no-event-name": func() *message.Message { return message.NewMessage(newID(), []byte(`{}`)) },
		"not-a-uuid": func() *message.Message {
			m := message.NewMessage(watermill.NewULID(), []byte(`{}`))
			m.Metadata.Set(marshaler.MetadataEventName, "email.requested")
			return m
		},
		"payload-not-json": func() *message.Message {
			m := message.NewMessage(newID(), []byte(`not json`))
			m.Metadata.Set(marshaler.MetadataEventName, "email.requested")
			return m
		},
	}
	for kind, mk := range bad {
		for _, path := range []string{"returned-router", "returned-outbox", "context-publisher"} {
			t.Run(kind+"/"+path, func(t *testing.T) {
				t.Parallel()
				consumer := "c-" + kind + "-" + path
				var publishErr error
				h := e.mw(e.pool, func(c *inbox.Config) {
					c.Consumer = consumer
					if path != "returned-router" {
						c.Outbox, c.OutboxTopic = ob, "out"
					}
				})(func(msg *message.Message) ([]*message.Message, error) {
					if err := writeEffect(msg, consumer); err != nil {
						return nil, err
					}
					if path == "context-publisher" {
						pub, ok := inbox.PublisherFromContext(msg.Context())
						require.True(t, ok)
						publishErr = pub.Publish("out", mk())
						return nil, nil // ignores the refusal
					}
					return []*message.Message{mk()}, nil
				})
				id := newID()
				produced, err := h(newMsg(id))
				require.Empty(t, produced)
				require.ErrorIs(t, err, inbox.ErrInvalidProduced)
				require.True(t, inbox.IsPermanent(err))
				var perr *inbox.PermanentError
				require.ErrorAs(t, err, &perr)
				require.Equal(t, "invalid_produced", perr.Reason)
				if path == "context-publisher" {
					require.ErrorIs(t, publishErr, inbox.ErrInvalidProduced, "Publish refuses at once")
				}
				require.Zero(t, e.processed(id))
				require.Zero(t, e.count(`SELECT count(*) FROM effect WHERE note = $1`, consumer))
			})
		}
	}
	require.Zero(t, e.outboxRows())
}
