// Package transporttest is the transport contract suite: the at-least-once
// faults every Watermill Pub/Sub shows (a duplicate publish, a redelivery
// after a lost ack, a connection cut after commit, a malformed body, copies
// consumed concurrently, a failure before commit) run through a real router,
// the public door (middleware.NewConsumer and its AddConsumerHandler, the
// whole chain) and PostgreSQL, against one transport.
// Each transport's test calls [Run] with a [Transport] (see the _test files
// of this package for RabbitMQ, NATS JetStream, Redis Streams and GoChannel).
//
// The contract, checked by every scenario: each event's effect is applied
// exactly once, a malformed body reaches the poison topic once and never a
// handler, and nothing is left unprocessed on the broker.
package transporttest

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/faultproxy"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
)

// Transport is one Pub/Sub under test.
type Transport struct {
	// Name names the transport in test output.
	Name string
	// BrokerAddr is the broker's host:port, for the connection-cut scenario
	// (a fault proxy sits in front of it). Empty for an in-process transport
	// (GoChannel), which skips that scenario.
	BrokerAddr string
	// NewTopic gives a fresh, isolated topic (and its consumer group) and
	// removes it in t.Cleanup.
	NewTopic func(t *testing.T) Topic
}

// Topic is one isolated topic on a transport.
type Topic struct {
	// Name is the Watermill topic.
	Name string
	// Publisher publishes to any topic of the transport.
	Publisher message.Publisher
	// NewSubscriber returns a subscriber of the topic's consumer group
	// (competing with the others) connected to addr (BrokerAddr or a proxy
	// in front of it; ignored by in-process transports). The suite closes it.
	NewSubscriber func(t *testing.T, addr string) message.Subscriber
	// PublishRaw publishes body as a producer that is not ours would: no
	// envelope, no Watermill headers.
	PublishRaw func(t *testing.T, body []byte)
	// Republish, when set, publishes a copy of an already published message
	// the way a republish the broker does not deduplicate arrives (JetStream
	// drops a second publish with the same Nats-Msg-Id inside its duplicate
	// window: a copy past the window has none). Nil means Publisher.Publish.
	Republish func(t *testing.T, msg *message.Message)
	// Pending reports how many messages of the topic are not yet acked by
	// the group (delivered and unacked, or not delivered yet); nil when the
	// transport cannot tell.
	Pending func(t *testing.T) int
}

// Run runs every scenario of the contract against tr, as parallel subtests.
func Run(t *testing.T, tr Transport) {
	t.Run("Duplicate", func(t *testing.T) { t.Parallel(); duplicate(t, tr) })
	t.Run("LostAckRedelivered", func(t *testing.T) { t.Parallel(); lostAck(t, tr) })
	t.Run("FailureBeforeCommit", func(t *testing.T) { t.Parallel(); beforeCommit(t, tr) })
	t.Run("ConnectionCutAfterCommit", func(t *testing.T) { t.Parallel(); cutAfterCommit(t, tr) })
	t.Run("MalformedPoisonedOnce", func(t *testing.T) { t.Parallel(); malformed(t, tr) })
	t.Run("ConcurrentCopies", func(t *testing.T) { t.Parallel(); concurrentCopies(t, tr) })
}

// wait is the deadline of every poll: generous for a loaded machine; a
// healthy run takes well under a second per scenario.
const wait = 30 * time.Second

// rig is one scenario's consumer side: a PostgreSQL schema with the
// processed-event table and an effect table, the transport topic and its poison
// topic, and counters.
type rig struct {
	t      *testing.T
	tr     Transport
	pool   *pgxpool.Pool
	topic  Topic
	poison Topic

	mu        sync.Mutex
	delivered map[string]int // wrapper saw the delivery (UUID)
	finished  map[string]int // the chain returned nil for it
	calls     map[string]int // the handler ran for it
	malformed atomic.Int32   // deliveries flagged malformed
	poisoned  atomic.Int32   // messages on the poison topic
}

func newRig(t *testing.T, tr Transport) *rig {
	t.Helper()
	pool, _ := testenv.Pool(t)
	require.NoError(t, processed.Migrate(context.Background(), idempotency.Pgx(pool), processed.Config{}))
	_, err := pool.Exec(context.Background(), `CREATE TABLE effect (id bigserial PRIMARY KEY, event_id uuid NOT NULL)`)
	require.NoError(t, err)
	r := &rig{t: t, tr: tr, pool: pool, topic: tr.NewTopic(t), poison: tr.NewTopic(t),
		delivered: map[string]int{}, finished: map[string]int{}, calls: map[string]int{}}
	r.countPoison()
	return r
}

// countPoison consumes the poison topic in the background.
func (r *rig) countPoison() {
	sub := r.poison.NewSubscriber(r.t, r.tr.BrokerAddr)
	ctx, cancel := context.WithCancel(context.Background())
	ch, err := sub.Subscribe(ctx, r.poison.Name)
	require.NoError(r.t, err)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for m := range ch {
			r.poisoned.Add(1)
			m.Ack()
		}
	}()
	r.t.Cleanup(func() {
		cancel()
		_ = sub.Close()
		<-done
	})
}

// wrapper is a router middleware outside the chain: fault is called after
// the chain returned, with the delivery's error; its result replaces it.
type wrapper func(msg *message.Message, err error) error

// consumer runs one router on sub; stop closes it (idempotent).
type consumer struct {
	router *message.Router
	sub    message.Subscriber
	done   chan struct{}
	once   sync.Once
}

func (c *consumer) stop() {
	c.once.Do(func() {
		_ = c.router.Close()
		<-c.done
		_ = c.sub.Close()
	})
}

func (r *rig) start(sub message.Subscriber, fault wrapper) *consumer {
	r.t.Helper()
	logger := watermill.NopLogger{}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, logger)
	require.NoError(r.t, err)
	// One Consumer per router (a Consumer serves one handler); competing
	// workers share the consumer name and the handler name.
	c, err := middleware.NewConsumer(middleware.ConsumerConfig{
		Consumer: "contract",
		DB:       idempotency.Pgx(r.pool),
		Poison:   middleware.PoisonConfig{Publisher: r.poison.Publisher, Topic: r.poison.Name},
		Retry:    middleware.RetryConfig{MaxRetries: 2, InitialInterval: 10 * time.Millisecond, MaxInterval: 50 * time.Millisecond},
	}, logger)
	require.NoError(r.t, err)
	// Router-level middleware runs outside the consumer's chain, which
	// AddConsumerHandler adds at the handler's level.
	router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			r.mu.Lock()
			r.delivered[msg.UUID]++
			r.mu.Unlock()
			if _, bad := marshaler.Malformed(msg); bad {
				r.malformed.Add(1)
			}
			out, err := h(msg)
			if fault != nil {
				err = fault(msg, err)
			}
			if err == nil {
				r.mu.Lock()
				r.finished[msg.UUID]++
				r.mu.Unlock()
			}
			return out, err
		}
	})
	_, err = c.AddConsumerHandler(router, "contract", r.topic.Name, sub, func(msg *message.Message) error {
		r.mu.Lock()
		r.calls[msg.UUID]++
		r.mu.Unlock()
		tx, ok := middleware.PgxTxFromContext(msg.Context())
		if !ok {
			return errors.New("no transaction in the context")
		}
		_, err := tx.Exec(msg.Context(), `INSERT INTO effect (event_id) VALUES ($1)`, msg.UUID)
		if err != nil {
			return err
		}
		return beforeCommitFault(msg)
	})
	require.NoError(r.t, err)
	cons := &consumer{router: router, sub: sub, done: make(chan struct{})}
	go func() {
		defer close(cons.done)
		_ = router.Run(context.Background())
	}()
	select {
	case <-router.Running():
	case <-time.After(wait):
		r.t.Fatal("router did not start")
	}
	r.t.Cleanup(cons.stop)
	return cons
}

// beforeCommitFaults holds, per event id, how many more attempts must fail
// after writing their effect (the transaction then rolls back).
var beforeCommitFaults sync.Map

func beforeCommitFault(msg *message.Message) error {
	v, ok := beforeCommitFaults.Load(msg.UUID)
	if !ok {
		return nil
	}
	n := v.(*atomic.Int32)
	if n.Add(-1) >= 0 {
		// Transient: not retried into the poison topic, nacked for the
		// transport to redeliver.
		return middleware.Transient(errors.New("contract: crash before commit"))
	}
	return nil
}

func (r *rig) subscriber() message.Subscriber {
	return r.topic.NewSubscriber(r.t, r.tr.BrokerAddr)
}

// publish returns a new event, published copies times.
func (r *rig) publish(copies int) *message.Message {
	r.t.Helper()
	msg, err := marshaler.NewMessage("contract.happened", map[string]string{"k": "v"})
	require.NoError(r.t, err)
	for i := 0; i < copies; i++ {
		if i > 0 && r.topic.Republish != nil {
			r.topic.Republish(r.t, msg.Copy())
			continue
		}
		require.NoError(r.t, r.topic.Publisher.Publish(r.topic.Name, msg.Copy()))
	}
	return msg
}

func (r *rig) effects(id string) int {
	r.t.Helper()
	var n int
	require.NoError(r.t, r.pool.QueryRow(context.Background(), `SELECT count(*) FROM effect WHERE event_id = $1`, id).Scan(&n))
	return n
}

func (r *rig) get(m map[string]int, id string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return m[id]
}

// settled waits until every id is applied and the broker holds nothing
// unacked for the group, then checks each effect happened exactly once.
func (r *rig) settled(ids ...string) {
	r.t.Helper()
	require.Eventually(r.t, func() bool {
		for _, id := range ids {
			if r.effects(id) == 0 || r.get(r.finished, id) == 0 {
				return false
			}
		}
		return r.topic.Pending == nil || r.topic.Pending(r.t) == 0
	}, wait, 20*time.Millisecond, "not every event was processed and acked")
	for _, id := range ids {
		require.Equal(r.t, 1, r.effects(id), "event %s applied %d times", id, r.effects(id))
	}
}

func duplicate(t *testing.T, tr Transport) {
	r := newRig(t, tr)
	r.start(r.subscriber(), nil)
	twice := r.publish(2)
	once := r.publish(1)
	require.Eventually(t, func() bool { return r.get(r.finished, twice.UUID) >= 2 }, wait, 10*time.Millisecond)
	r.settled(twice.UUID, once.UUID)
	require.Equal(t, 1, r.get(r.calls, twice.UUID), "the duplicate reached the handler")
}

func lostAck(t *testing.T, tr Transport) {
	r := newRig(t, tr)
	var lost sync.Map
	r.start(r.subscriber(), func(msg *message.Message, err error) error {
		if _, seen := lost.LoadOrStore(msg.UUID, true); !seen && err == nil {
			return errors.New("contract: the ack was lost") // committed, then nacked
		}
		return err
	})
	ev := r.publish(1)
	require.Eventually(t, func() bool { return r.get(r.delivered, ev.UUID) >= 2 }, wait, 10*time.Millisecond,
		"the transport did not redeliver after the lost ack")
	r.settled(ev.UUID)
	require.Equal(t, 1, r.get(r.calls, ev.UUID), "the redelivery reached the handler")
}

func beforeCommit(t *testing.T, tr Transport) {
	r := newRig(t, tr)
	r.start(r.subscriber(), nil)
	msg, err := marshaler.NewMessage("contract.happened", map[string]string{"k": "v"})
	require.NoError(t, err)
	n := &atomic.Int32{}
	n.Store(4) // more than the chain's in-process retries
	beforeCommitFaults.Store(msg.UUID, n)
	t.Cleanup(func() { beforeCommitFaults.Delete(msg.UUID) })
	require.NoError(t, r.topic.Publisher.Publish(r.topic.Name, msg))
	r.settled(msg.UUID)
	require.GreaterOrEqual(t, r.get(r.calls, msg.UUID), 5, "each failed attempt ran the handler")
	// The chain holds a transient failure in place (retries it without
	// giving the delivery back), so no redelivery spends the transport's
	// delivery limit (quorum x-delivery-limit, JetStream MaxDeliver).
	require.Equal(t, 1, r.get(r.delivered, msg.UUID), "held in place: the transport delivered it once")
	require.Zero(t, r.poisoned.Load(), "a transient failure reached the poison topic")
}

func cutAfterCommit(t *testing.T, tr Transport) {
	if tr.BrokerAddr == "" {
		t.Skip("in-process transport: no connection to cut, and nothing survives the subscriber")
	}
	r := newRig(t, tr)
	proxy, err := faultproxy.Start(tr.BrokerAddr)
	require.NoError(t, err)
	t.Cleanup(func() { _ = proxy.Close() })

	committed := make(chan struct{})
	cut := make(chan struct{})
	var first atomic.Bool
	c1 := r.start(r.topic.NewSubscriber(t, proxy.Addr()), func(msg *message.Message, err error) error {
		if err == nil && first.CompareAndSwap(false, true) {
			close(committed)
			<-cut // the ack goes out on a dead connection
		}
		return err
	})
	ev := r.publish(1)
	select {
	case <-committed:
	case <-time.After(wait):
		t.Fatal("the event was not processed")
	}
	proxy.Refuse(time.Hour)
	close(cut)
	require.Equal(t, 1, r.effects(ev.UUID))

	r.start(r.subscriber(), nil) // another worker of the same group
	require.Eventually(t, func() bool { return r.get(r.delivered, ev.UUID) >= 2 }, wait, 10*time.Millisecond,
		"the transport did not redeliver the unacked event")
	go c1.stop() // its subscriber may retry the dead proxy for a while
	r.settled(ev.UUID)
	require.Equal(t, 1, r.get(r.calls, ev.UUID), "the redelivery reached the handler")
}

func malformed(t *testing.T, tr Transport) {
	r := newRig(t, tr)
	r.start(r.subscriber(), nil)
	r.topic.PublishRaw(t, []byte("\xff this is not an envelope"))
	ev := r.publish(1)
	require.Eventually(t, func() bool { return r.poisoned.Load() >= 1 }, wait, 10*time.Millisecond,
		"the malformed body did not reach the poison topic")
	r.settled(ev.UUID)
	require.Equal(t, int32(1), r.malformed.Load(), "the malformed body was delivered again (a loop)")
	require.Equal(t, int32(1), r.poisoned.Load(), "poisoned more than once")
	r.mu.Lock()
	defer r.mu.Unlock()
	for id, n := range r.calls {
		require.Equal(t, ev.UUID, id, "a handler ran for something else than the valid event (%d times)", n)
	}
}

func concurrentCopies(t *testing.T, tr Transport) {
	r := newRig(t, tr)
	for i := 0; i < 3; i++ {
		r.start(r.subscriber(), nil)
	}
	ev := r.publish(6)
	require.Eventually(t, func() bool { return r.get(r.finished, ev.UUID) >= 6 }, wait, 10*time.Millisecond)
	r.settled(ev.UUID)
	require.Equal(t, 1, r.get(r.calls, ev.UUID), "a copy reached the handler after the first committed")
}

// Load is the contract under load and broker faults: workers competing
// consumers of one topic, n events published meanwhile (each publish retried
// until the broker takes it, as a relay does while a broker fails over), and
// fault run concurrently with a function reporting how many distinct events
// have been applied so far. When fault has returned and every event was
// published, Load waits until every event is applied and acked, and checks
// that each effect happened exactly once. publishDeadline bounds the retries
// of one publish.
func Load(t *testing.T, tr Transport, n, workers int, publishDeadline time.Duration, fault func(applied func() int)) {
	t.Helper()
	r := newRig(t, tr)
	for i := 0; i < workers; i++ {
		r.start(r.subscriber(), nil)
	}
	applied := func() int {
		var k int
		require.NoError(t, r.pool.QueryRow(context.Background(), `SELECT count(DISTINCT event_id) FROM effect`).Scan(&k))
		return k
	}
	ids := make([]string, n)
	published := make(chan error, 1)
	go func() {
		for i := range ids {
			msg, err := marshaler.NewMessage("contract.load", map[string]int{"i": i})
			if err != nil {
				published <- err
				return
			}
			ids[i] = msg.UUID
			deadline := time.Now().Add(publishDeadline)
			for {
				err = r.topic.Publisher.Publish(r.topic.Name, msg.Copy())
				if err == nil {
					break
				}
				if time.Now().After(deadline) {
					published <- err
					return
				}
				time.Sleep(50 * time.Millisecond) // backoff between publish attempts, not a wait for work
			}
		}
		published <- nil
	}()
	fault(applied)
	require.NoError(t, <-published, "a publish did not succeed within its deadline")
	require.Eventually(t, func() bool {
		return applied() == n && (r.topic.Pending == nil || r.topic.Pending(t) == 0)
	}, 2*wait, 50*time.Millisecond, "not every event was applied and acked")
	var rows, distinct int
	require.NoError(t, r.pool.QueryRow(context.Background(), `SELECT count(*), count(DISTINCT event_id) FROM effect`).Scan(&rows, &distinct))
	require.Equal(t, n, distinct)
	require.Equal(t, n, rows, "an effect was applied twice")
	require.Zero(t, r.poisoned.Load(), "a broker fault poisoned an event")
}
