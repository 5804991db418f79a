package middleware_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
)

// consumerEnv is a migrated processed table and an effects table in a
// schema of the test's own, and an in-process broker.
type consumerEnv struct {
	pool   *pgxpool.Pool
	db     idempotency.DB
	pubsub *gochannel.GoChannel
}

func newConsumerEnv(t *testing.T) consumerEnv {
	t.Helper()
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	db := idempotency.Pgx(pool)
	require.NoError(t, processed.Migrate(ctx, db, processed.Config{}))
	_, err := pool.Exec(ctx, `CREATE TABLE effect (event_id text NOT NULL, note text)`)
	require.NoError(t, err)
	ps := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64, Persistent: true}, watermill.NopLogger{})
	t.Cleanup(func() { _ = ps.Close() })
	return consumerEnv{pool: pool, db: db, pubsub: ps}
}

func (e consumerEnv) config(name string) middleware.ConsumerConfig {
	return middleware.ConsumerConfig{
		Consumer: name, DB: e.db,
		Poison: middleware.PoisonConfig{Publisher: e.pubsub, Topic: "poison"},
		Retry:  middleware.RetryConfig{InitialInterval: time.Millisecond, MaxInterval: 5 * time.Millisecond},
	}
}

func (e consumerEnv) effects(t *testing.T) int {
	t.Helper()
	var n int
	require.NoError(t, e.pool.QueryRow(context.Background(), `SELECT count(*) FROM effect`).Scan(&n))
	return n
}

func runRouter(t *testing.T, r *message.Router) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	<-r.Running()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
}

func newEvent(t *testing.T) *message.Message {
	t.Helper()
	msg, err := marshaler.NewMessage("order.placed", map[string]string{"order_id": "o-1"})
	require.NoError(t, err)
	return msg
}

// A redelivered event (same event_id) applies its effect once; the handler
// is not called for the duplicate. A failed attempt leaves nothing: its
// effect rolls back with its claim, and the retry applies it once (C01).
func TestConsumerAppliesEachEventOnce(t *testing.T) {
	t.Parallel()
	e := newConsumerEnv(t)
	c, err := middleware.NewConsumer(e.config("stock"), nil)
	require.NoError(t, err)
	r, err := message.NewRouter(message.RouterConfig{}, nil)
	require.NoError(t, err)
	var calls atomic.Int32
	_, err = c.AddConsumerHandler(r, "reserve", "orders", e.pubsub, func(msg *message.Message) error {
		tx, ok := middleware.PgxTxFromContext(msg.Context())
		if !ok {
			return errors.New("no transaction")
		}
		if _, err := tx.Exec(msg.Context(), `INSERT INTO effect (event_id) VALUES ($1)`, msg.UUID); err != nil {
			return err
		}
		if calls.Add(1) == 1 {
			return errors.New("first attempt fails after its write")
		}
		return nil
	})
	require.NoError(t, err)
	runRouter(t, r)

	msg := newEvent(t)
	require.NoError(t, e.pubsub.Publish("orders", msg, msg.Copy()))
	testenv.Eventually(t, 10*time.Second, "one effect", func(o *testenv.Observed) bool {
		return testenv.See(o, "effects", e.effects(t)) == 1 && testenv.See(o, "calls", calls.Load()) == 2
	})
	second := newEvent(t)
	require.NoError(t, e.pubsub.Publish("orders", second))
	testenv.Eventually(t, 10*time.Second, "second event applied", func(o *testenv.Observed) bool {
		return testenv.See(o, "effects", e.effects(t)) == 2
	})
	require.Equal(t, int32(3), calls.Load(), "the duplicate never reached the handler")
}

// A Consumer serves one handler: a second attach is refused, so its claim
// cannot be wired twice.
func TestConsumerServesOneHandler(t *testing.T) {
	t.Parallel()
	e := newConsumerEnv(t)
	c, err := middleware.NewConsumer(e.config("stock"), nil)
	require.NoError(t, err)
	r, err := message.NewRouter(message.RouterConfig{}, nil)
	require.NoError(t, err)
	h := func(*message.Message) error { return nil }
	_, err = c.AddConsumerHandler(r, "a", "orders", e.pubsub, h)
	require.NoError(t, err)
	_, err = c.AddConsumerHandler(r, "b", "orders", e.pubsub, h)
	require.ErrorIs(t, err, middleware.ErrAttached)
}

// Two handlers that each receive their own copy of an event must not share
// a consumer name: the second is refused at startup. Competing workers (the
// same handler name, e.g. two routers) share it.
func TestConsumerNameSharedByTwoHandlersIsRefused(t *testing.T) {
	t.Parallel()
	e := newConsumerEnv(t)
	h := func(*message.Message) error { return nil }
	r, err := message.NewRouter(message.RouterConfig{}, nil)
	require.NoError(t, err)
	first, err := middleware.NewConsumer(e.config("mail"), nil)
	require.NoError(t, err)
	_, err = first.AddConsumerHandler(r, "send_mail", "orders", e.pubsub, h)
	require.NoError(t, err)

	fanout, err := middleware.NewConsumer(e.config("mail"), nil)
	require.NoError(t, err)
	_, err = fanout.AddConsumerHandler(r, "send_sms", "orders", e.pubsub, h)
	require.ErrorIs(t, err, middleware.ErrSharedConsumer)

	r2, err := message.NewRouter(message.RouterConfig{}, nil)
	require.NoError(t, err)
	worker, err := middleware.NewConsumer(e.config("mail"), nil)
	require.NoError(t, err)
	_, err = worker.AddConsumerHandler(r2, "send_mail", "orders", e.pubsub, h)
	require.NoError(t, err, "a competing worker of the same handler")
}

// The replay horizon lives with the table: the first consumer records it,
// another value is refused, 0 adopts it, and SetReplayHorizon changes it.
func TestConsumerReplayHorizonLivesWithTheTable(t *testing.T) {
	t.Parallel()
	e := newConsumerEnv(t)
	ctx := context.Background()
	cfg := e.config("stock")
	cfg.ReplayHorizon = 24 * time.Hour
	_, err := middleware.NewConsumer(cfg, nil)
	require.NoError(t, err)
	got, err := processed.ReplayHorizon(ctx, e.db, "")
	require.NoError(t, err)
	require.Equal(t, 24*time.Hour, got)

	cfg.Consumer, cfg.ReplayHorizon = "shipping", 48*time.Hour
	_, err = middleware.NewConsumer(cfg, nil)
	require.ErrorIs(t, err, processed.ErrHorizonMismatch)

	cfg.ReplayHorizon = 0
	_, err = middleware.NewConsumer(cfg, nil)
	require.NoError(t, err, "0 adopts the table's horizon")

	require.NoError(t, processed.SetReplayHorizon(ctx, e.db, "", 48*time.Hour))
	cfg.ReplayHorizon = 48 * time.Hour
	_, err = middleware.NewConsumer(cfg, nil)
	require.NoError(t, err)
}

// An event older than the table's horizon is refused as expired and
// poisoned once; it never reaches the handler.
func TestConsumerRefusesEventsOlderThanTheHorizon(t *testing.T) {
	t.Parallel()
	e := newConsumerEnv(t)
	cfg := e.config("stock")
	cfg.ReplayHorizon = time.Hour
	c, err := middleware.NewConsumer(cfg, nil)
	require.NoError(t, err)
	r, err := message.NewRouter(message.RouterConfig{}, nil)
	require.NoError(t, err)
	var calls atomic.Int32
	_, err = c.AddConsumerHandler(r, "reserve", "orders", e.pubsub, func(*message.Message) error {
		calls.Add(1)
		return nil
	})
	require.NoError(t, err)
	poisoned, err := e.pubsub.Subscribe(context.Background(), "poison")
	require.NoError(t, err)
	runRouter(t, r)

	msg, err := marshaler.NewMessageWithID(uuidV7At(t, time.Now().Add(-2*time.Hour)), "order.placed",
		time.Now().Add(-2*time.Hour), map[string]string{"order_id": "o-1"})
	require.NoError(t, err)
	require.NoError(t, e.pubsub.Publish("orders", msg))
	select {
	case p := <-poisoned:
		p.Ack()
		require.Equal(t, msg.UUID, p.UUID)
	case <-time.After(10 * time.Second):
		t.Fatal("the expired event was not poisoned")
	}
	require.Zero(t, calls.Load())
}

// The purger deletes by the table's horizon: rows older than it go, newer
// ones stay; a table without a horizon is never purged.
func TestPurgerUsesTheTableHorizon(t *testing.T) {
	t.Parallel()
	e := newConsumerEnv(t)
	ctx := context.Background()
	p, err := processed.NewPurger(processed.PurgerConfig{DB: e.db}, nil)
	require.NoError(t, err)
	_, ran, err := p.PurgeNow(ctx)
	require.NoError(t, err)
	require.False(t, ran, "no horizon recorded: nothing may be purged")

	require.NoError(t, processed.SetReplayHorizon(ctx, e.db, "", 2*time.Hour))
	_, err = e.pool.Exec(ctx, `INSERT INTO processed_event (consumer, event_id, event_at) VALUES
		('c', gen_random_uuid(), now() - interval '3 hours'), ('c', gen_random_uuid(), now() - interval '1 hour')`)
	require.NoError(t, err)
	n, ran, err := p.PurgeNow(ctx)
	require.NoError(t, err)
	require.True(t, ran)
	require.Equal(t, int64(1), n)
}

// Each field a consumer cannot do without is named when missing.
func TestConsumerConfigNamesTheMissingField(t *testing.T) {
	t.Parallel()
	e := newConsumerEnv(t)
	for field, mutate := range map[string]func(*middleware.ConsumerConfig){
		"Consumer":         func(c *middleware.ConsumerConfig) { c.Consumer = " " },
		"DB":               func(c *middleware.ConsumerConfig) { c.DB = idempotency.DB{} },
		"Poison.Publisher": func(c *middleware.ConsumerConfig) { c.Poison.Publisher = nil },
		"Poison.Topic":     func(c *middleware.ConsumerConfig) { c.Poison.Topic = "" },
	} {
		cfg := e.config("x")
		mutate(&cfg)
		_, err := middleware.NewConsumer(cfg, nil)
		require.ErrorContains(t, err, "ConsumerConfig."+field, field)
	}
}

// uuidV7At is a UUIDv7 dated at (RFC 9562 §5.7: 48-bit Unix milliseconds).
func uuidV7At(t *testing.T, at time.Time) uuid.UUID {
	t.Helper()
	id, err := uuid.NewV7()
	require.NoError(t, err)
	ms := uint64(at.UnixMilli())
	for i := 0; i < 6; i++ {
		id[i] = byte(ms >> (40 - 8*i))
	}
	return id
}

// Another process (another pool on the same table) attaching the same
// consumer name to another handler is reported at ERROR: this process
// cannot refuse it, but says so at startup.
func TestConsumerNameSharedAcrossProcessesIsReported(t *testing.T) {
	t.Parallel()
	e := newConsumerEnv(t)
	h := func(*message.Message) error { return nil }
	r, err := message.NewRouter(message.RouterConfig{}, nil)
	require.NoError(t, err)
	first, err := middleware.NewConsumer(e.config("mail"), nil)
	require.NoError(t, err)
	_, err = first.AddConsumerHandler(r, "send_mail", "orders", e.pubsub, h)
	require.NoError(t, err)

	process := func() middleware.ConsumerConfig { // another process: a pool of its own on the same table
		cfg := e.config("mail")
		cfg.DB = idempotency.Pgx(testenv.PoolOn(t, schemaOf(t, e.pool), 2))
		return cfg
	}
	quiet := watermill.NewCaptureLogger()
	worker, err := middleware.NewConsumer(process(), quiet)
	require.NoError(t, err)
	r2, err := message.NewRouter(message.RouterConfig{}, nil)
	require.NoError(t, err)
	_, err = worker.AddConsumerHandler(r2, "send_mail", "orders", e.pubsub, h)
	require.NoError(t, err)
	require.False(t, quiet.HasError(middleware.ErrSharedConsumer), "a competing worker of send_mail is not reported")

	logs := watermill.NewCaptureLogger()
	second, err := middleware.NewConsumer(process(), logs)
	require.NoError(t, err)
	r3, err := message.NewRouter(message.RouterConfig{}, nil)
	require.NoError(t, err)
	_, err = second.AddConsumerHandler(r3, "send_sms", "orders", e.pubsub, h)
	require.NoError(t, err, "another process cannot be refused")
	require.True(t, logs.HasError(middleware.ErrSharedConsumer), "reported at ERROR")
}

func schemaOf(t *testing.T, pool *pgxpool.Pool) string {
	t.Helper()
	var s string
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT current_schema()`).Scan(&s))
	return s
}

// On the partitioned layout the purger drops the partitions wholly older
// than the table's horizon and creates the ones ahead.
func TestPurgerMaintainsPartitionsByTheTableHorizon(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	db := idempotency.Pgx(pool)
	cfg := processed.Config{Layout: processed.LayoutPartitioned}
	require.NoError(t, processed.Migrate(ctx, db, cfg))
	require.NoError(t, processed.SetReplayHorizon(ctx, db, "", 2*time.Hour))
	p, err := processed.NewPurger(processed.PurgerConfig{DB: db, Layout: processed.LayoutPartitioned}, nil)
	require.NoError(t, err)
	_, ran, err := p.PurgeNow(ctx)
	require.NoError(t, err)
	require.True(t, ran)
	var parts int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM pg_inherits WHERE inhparent = 'processed_event'::regclass`).Scan(&parts))
	require.Greater(t, parts, 2, "partitions ahead exist beside default and other")
}

// A handler that runs a session-level SET search_path (not SET LOCAL)
// leaves it on its pooled connection. NewConsumer names an unqualified
// table with the schema it found it in, so the redelivery on that
// connection claims in the same table: a duplicate, never reaching the
// handler, and no claim lands in the other schema's same-named table, on
// both layouts. (A table created after the consumer stays unqualified,
// unmarked, and the commit guard catches a moved claim:
// internal/inbox TestClaimMovedBySearchPathIsCaughtWhenTheTableCameAfterTheConsumer.)
func TestConsumerKeepsItsTableWhenAHandlerSetsSearchPath(t *testing.T) {
	t.Parallel()
	for _, layout := range []processed.Layout{processed.LayoutPlain, processed.LayoutPartitioned} {
		t.Run(map[processed.Layout]string{processed.LayoutPlain: "plain", processed.LayoutPartitioned: "partitioned"}[layout], func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			admin, schema := testenv.Pool(t)
			other := testenv.Schema(t) // another tenant's schema, with a table of the same name
			require.NoError(t, processed.Migrate(ctx, idempotency.Pgx(admin), processed.Config{Layout: layout}))
			require.NoError(t, processed.Migrate(ctx, idempotency.Pgx(testenv.PoolOn(t, other, 1)), processed.Config{Layout: layout}))
			_, err := admin.Exec(ctx, `CREATE TABLE effect (event_id text NOT NULL, note text)`)
			require.NoError(t, err)
			pool := testenv.PoolOn(t, schema, 1) // one connection: the redelivery runs where the SET stayed
			// Publish returns once the handler acked: the three deliveries
			// are handled one after the other, in order (a gochannel
			// delivers each publish from a goroutine of its own otherwise).
			ps := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
			t.Cleanup(func() { _ = ps.Close() })
			pp := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 8, Persistent: true}, watermill.NopLogger{})
			t.Cleanup(func() { _ = pp.Close() })
			c, err := middleware.NewConsumer(middleware.ConsumerConfig{
				Consumer: "stock", DB: idempotency.Pgx(pool), Layout: layout,
				Poison: middleware.PoisonConfig{Publisher: pp, Topic: "poison"},
			}, nil)
			require.NoError(t, err)
			poisoned, err := pp.Subscribe(ctx, "poison")
			require.NoError(t, err)
			r, err := message.NewRouter(message.RouterConfig{}, nil)
			require.NoError(t, err)
			calls := map[string]int{}
			var mu sync.Mutex
			_, err = c.AddConsumerHandler(r, "reserve", "orders", ps, func(msg *message.Message) error {
				mu.Lock()
				calls[msg.UUID]++
				mu.Unlock()
				tx, _ := middleware.PgxTxFromContext(msg.Context())
				if _, err := tx.Exec(msg.Context(), `INSERT INTO `+schema+`.effect (event_id) VALUES ($1)`, msg.UUID); err != nil {
					return err
				}
				_, err := tx.Exec(msg.Context(), `SET search_path = `+other)
				return err
			})
			require.NoError(t, err)
			runRouter(t, r)
			first, last := newEvent(t), newEvent(t)
			for _, m := range []*message.Message{first, first.Copy(), last} {
				require.NoError(t, ps.Publish("orders", m))
			}
			var effects, moved int
			require.NoError(t, admin.QueryRow(ctx, `SELECT count(*) FROM effect WHERE event_id = $1`, first.UUID).Scan(&effects))
			require.NoError(t, admin.QueryRow(ctx, `SELECT count(*) FROM `+other+`.processed_event`).Scan(&moved))
			require.Equal(t, 1, effects, "the redelivery is a duplicate")
			require.Zero(t, moved, "no claim in the other schema's table")
			mu.Lock()
			require.Equal(t, 1, calls[first.UUID], "the duplicate never reached the handler")
			mu.Unlock()
			select {
			case p := <-poisoned:
				t.Fatalf("poisoned: %s", p.Metadata.Get("reason_poisoned"))
			default:
			}
		})
	}
}
