package inbox_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/faultproxy"
	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	amqpmarshaler "github.com/watermill-idempotency/idempotency/marshaler/amqp"
)

// rabbit is one test's broker side: unique queues, deleted at the end.
type rabbit struct {
	t     *testing.T
	conn  *amqp091.Connection
	ch    *amqp091.Channel
	queue string
	dlq   string
	cfg   amqp.Config
}

func newRabbit(t *testing.T) *rabbit {
	t.Helper()
	conn, err := amqp091.Dial(testenv.AMQPURL())
	require.NoError(t, err, "RabbitMQ at %s unreachable (start it: rabbitmq-server -detached)", testenv.AMQPURL())
	ch, err := conn.Channel()
	require.NoError(t, err)
	r := &rabbit{t: t, conn: conn, ch: ch, queue: testenv.UniqueName("mw_q"), dlq: testenv.UniqueName("mw_dlq")}
	for _, q := range []string{r.queue, r.dlq} {
		_, err := ch.QueueDeclare(q, true, false, false, false, nil)
		require.NoError(t, err)
	}
	t.Cleanup(func() {
		_, _ = r.ch.QueueDelete(r.queue, false, false, false)
		_, _ = r.ch.QueueDelete(r.dlq, false, false, false)
		_ = r.conn.Close()
	})
	r.cfg = amqp.NewDurableQueueConfig(testenv.AMQPURL())
	r.cfg.Marshaler = amqpmarshaler.Marshaler{}
	return r
}

func (r *rabbit) depth(q string) int {
	r.t.Helper()
	ch, err := r.conn.Channel()
	require.NoError(r.t, err)
	defer ch.Close()
	st, err := ch.QueueDeclarePassive(q, true, false, false, false, nil)
	require.NoError(r.t, err)
	return st.Messages
}

func (r *rabbit) publishEvents(n int) []string {
	r.t.Helper()
	pub, err := amqp.NewPublisher(r.cfg, watermill.NopLogger{})
	require.NoError(r.t, err)
	defer pub.Close()
	ids := make([]string, n)
	for i := range ids {
		m, err := marshaler.NewMessage("order.placed", map[string]int{"n": i})
		require.NoError(r.t, err)
		require.NoError(r.t, pub.Publish(r.queue, m))
		ids[i] = m.UUID
	}
	return ids
}

// consumer runs a router: AMQP subscriber → recommended chain (poison to the
// test's DLQ) → handler writing one effect. Stop closes it.
type consumer struct {
	router *message.Router
	done   chan struct{}
}

func startConsumer(t *testing.T, r *rabbit, e *env, pool *pgxpool.Pool, calls *atomic.Int32) *consumer {
	t.Helper()
	logger := watermill.NopLogger{}
	sub, err := amqp.NewSubscriber(r.cfg, logger)
	require.NoError(t, err)
	poisonPub, err := amqp.NewPublisher(r.cfg, logger)
	require.NoError(t, err)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, logger)
	require.NoError(t, err)
	idem, err := inbox.NewIdempotent(inbox.Config{
		Beginner: mustBeginner(inbox.NewPgxBeginner(pool, inbox.PgxBeginnerConfig{})),
		Store:    e.store,
		Consumer: "stock",
	}, logger)
	require.NoError(t, err)
	chain, err := inbox.NewChain(inbox.ChainConfig{
		Idempotent: idem, PoisonPublisher: poisonPub, PoisonTopic: r.dlq,
		MaxRetries: 3, InitialInterval: 50 * time.Millisecond, MaxInterval: 500 * time.Millisecond,
	}, logger)
	require.NoError(t, err)
	router.AddMiddleware(chain...)
	router.AddNoPublisherHandler("stock", r.queue, sub, func(msg *message.Message) error {
		calls.Add(1)
		return writeEffect(msg, "reserved")
	})
	c := &consumer{router: router, done: make(chan struct{})}
	go func() {
		defer close(c.done)
		_ = router.Run(context.Background())
	}()
	select {
	case <-router.Running():
	case <-time.After(30 * time.Second):
		t.Fatal("router did not start")
	}
	t.Cleanup(func() { c.stop(); _ = poisonPub.Close() })
	return c
}

func (c *consumer) stop() {
	_ = c.router.Close()
	<-c.done
}

func (e *env) allEffectsOnce(ids []string) bool {
	var n, distinct int
	require.NoError(e.t, e.pool.QueryRow(context.Background(),
		`SELECT count(*), count(DISTINCT event_id) FROM effect WHERE event_id = ANY($1::uuid[])`, ids).Scan(&n, &distinct))
	require.Equal(e.t, n, distinct, "an effect was applied twice")
	return n == len(ids)
}

// PostgreSQL unreachable for 10 s (every connection cut, new ones refused by a
// proxy; ten times the chain's retry budget here, 3 retries of at most
// 500 ms) while messages arrive: none is acked, none poisoned; after
// recovery each is processed once.
func TestDatabaseOutageNeitherAcksNorPoisons(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	r := newRabbit(t)
	cfg := testenv.PoolConfig(t, testenv.PostgresURL(), e.schema, 4)
	proxy, err := faultproxy.Start(fmt.Sprintf("%s:%d", cfg.ConnConfig.Host, cfg.ConnConfig.Port))
	require.NoError(t, err)
	defer proxy.Close()
	cfg.ConnConfig.Host, cfg.ConnConfig.Port = "127.0.0.1", uint16(proxy.Port())
	proxied, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	defer proxied.Close()

	var calls atomic.Int32
	startConsumer(t, r, e, proxied, &calls)
	before := r.publishEvents(5)
	require.Eventually(t, func() bool { return e.allEffectsOnce(before) }, 30*time.Second, 50*time.Millisecond)

	const outage = 10 * time.Second
	proxy.Refuse(outage)
	outageEnd := time.Now().Add(outage)
	during := r.publishEvents(20)
	// Publish returns before the broker has queued the message (no
	// publisher confirms here): wait until they are there (ready, or one
	// unacked in the consumer's hands), then sample.
	testenv.Eventually(t, 10*time.Second, "the messages queued", func(o *testenv.Observed) bool {
		return o.Int("ready", r.depth(r.queue)) >= len(during)-1
	})
	// While the database is gone nothing is applied, acked or poisoned: the
	// messages stay on the queue (ready, or unacked in the consumer's hands).
	for time.Now().Before(outageEnd.Add(-2 * time.Second)) {
		require.False(t, e.allEffectsOnceOrNone(during), "no effect can commit during the outage")
		require.Zero(t, r.depth(r.dlq), "an infrastructure failure reached the poison queue")
		require.GreaterOrEqual(t, r.depth(r.queue), len(during)-1, "a message was acked during the outage")
		time.Sleep(500 * time.Millisecond) // sampling cadence, not a wait for work
	}
	proxy.Restore()
	require.Eventually(t, func() bool { return e.allEffectsOnce(during) }, 60*time.Second, 100*time.Millisecond)
	require.Zero(t, r.depth(r.dlq))
	require.Eventually(t, func() bool { return r.depth(r.queue) == 0 }, 30*time.Second, 50*time.Millisecond)
	require.Equal(t, 25, e.count(`SELECT count(*) FROM processed_event`))
}

// allEffectsOnceOrNone reports whether any of ids has an effect (it must not
// during an outage); it fails the test on a double effect.
func (e *env) allEffectsOnceOrNone(ids []string) bool {
	var n int
	e.countCtx(&n, `SELECT count(*) FROM effect WHERE event_id = ANY($1::uuid[])`, ids)
	return n > 0
}

func (e *env) countCtx(dst *int, q string, args ...any) {
	require.NoError(e.t, e.pool.QueryRow(context.Background(), q, args...).Scan(dst))
}

// Closing the router while handlers run, then restarting it: every effect
// once, none lost, none doubled.
func TestShutdownUnderLoadNeitherLosesNorDoubles(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	r := newRabbit(t)
	ids := r.publishEvents(300)
	var calls atomic.Int32
	c := startConsumer(t, r, e, e.pool, &calls)
	require.Eventually(t, func() bool { return calls.Load() >= 60 }, 60*time.Second, 5*time.Millisecond)
	c.stop() // mid-stream
	stoppedAt := e.count(`SELECT count(*) FROM effect`)
	require.Less(t, stoppedAt, len(ids), "the close must happen mid-stream for this test to mean anything")
	startConsumer(t, r, e, e.pool, &calls)
	require.Eventually(t, func() bool { return e.allEffectsOnce(ids) }, 120*time.Second, 50*time.Millisecond)
	require.Eventually(t, func() bool { return r.depth(r.queue) == 0 }, 30*time.Second, 50*time.Millisecond)
	require.Zero(t, r.depth(r.dlq))
	t.Logf("stopped after %d effects; handler entered %d times for %d events", stoppedAt, calls.Load(), len(ids))
}
