package redisstream

import (
	"context"
	"encoding/json"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmredis "github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
)

// uncountedRun is one consumer process of TestEntriesReadWithoutCountingClientAreHeld:
// a router with the consumer "stock" on stream through a subscriber named
// member of the group "stock", whose client is counted or plain.
type uncountedRun struct {
	applied func() int
	logs    *errorLog
	stop    func()
}

// errorLog keeps the errors logged at ERROR level.
type errorLog struct {
	watermill.NopLogger
	mu   sync.Mutex
	errs []error
}

func (l *errorLog) Error(_ string, err error, _ watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.errs = append(l.errs, err)
}

func (l *errorLog) With(watermill.LogFields) watermill.LoggerAdapter { return l }

// heldForCountingClient reports whether an error naming CountingClient was
// logged.
func (l *errorLog) heldForCountingClient() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, err := range l.errs {
		if err != nil && strings.Contains(err.Error(), "redisstream.CountingClient") {
			return true
		}
	}
	return false
}

func startUncountedRun(t *testing.T, db idempotency.DB, stream, member string, counted bool, maxCrashes int) *uncountedRun {
	t.Helper()
	// Its own client: the Subscriber's Close closes it.
	var client redis.UniversalClient = redis.NewClient(&redis.Options{Addr: testenv.RedisAddr()})
	if counted {
		client = CountingClient(client)
	}
	logs := &errorLog{}
	sub, err := wmredis.NewSubscriber(wmredis.SubscriberConfig{
		Client: client, Unmarshaller: Marshaler{}, ConsumerGroup: "stock", Consumer: member, OldestId: "0",
		// The stopped member's pending entry is claimed by the next a
		// moment later.
		MaxIdleTime: 300 * time.Millisecond, ClaimInterval: 100 * time.Millisecond, BlockTime: 50 * time.Millisecond,
	}, watermill.NopLogger{})
	require.NoError(t, err)
	pub, err := wmredis.NewPublisher(wmredis.PublisherConfig{Client: client, Marshaller: Marshaler{}}, watermill.NopLogger{})
	require.NoError(t, err)
	c, err := middleware.NewConsumer(middleware.ConsumerConfig{
		Consumer: "stock", DB: db, MaxCrashes: maxCrashes,
		Poison: middleware.PoisonConfig{Publisher: pub, Topic: stream + ".dlq"},
		Retry:  middleware.RetryConfig{InitialInterval: time.Millisecond, MaxInterval: 20 * time.Millisecond},
	}, logs)
	require.NoError(t, err)
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	var mu sync.Mutex
	applied := 0
	_, err = c.AddConsumerHandler(r, "reserve", stream, sub, func(msg *message.Message) error {
		mu.Lock()
		defer mu.Unlock()
		applied++
		return nil
	})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	<-r.Running()
	var once sync.Once
	run := &uncountedRun{
		applied: func() int { mu.Lock(); defer mu.Unlock(); return applied },
		logs:    logs,
		stop:    func() { once.Do(func() { cancel(); require.NoError(t, <-done); _ = sub.Close() }) },
	}
	t.Cleanup(run.stop)
	return run
}

// A Redis Streams entry read through a plain client cannot be told from a
// claim of the pending entry that killed the last consumer, and a
// restarted consumer reads new entries first: under the crash bound such a
// killer would loop without end (docs/transports.md). So, with the crash
// bound on (the default), the consumer holds an entry read without
// CountingClient, with an error naming it: never applied, never acked,
// never dead-lettered. Once a subscriber with CountingClient claims it, it
// is applied once. With the crash bound off a plain client is served.
func TestEntriesReadWithoutCountingClientAreHeldUntilItWraps(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := testenv.Pool(t)
	db := idempotency.Pgx(pool)
	require.NoError(t, processed.Migrate(ctx, db, processed.Config{}))
	client := redis.NewClient(&redis.Options{Addr: testenv.RedisAddr()})
	t.Cleanup(func() { _ = client.Close() })
	stream := testenv.UniqueName("uncounted")
	t.Cleanup(func() { client.Del(context.Background(), stream, stream+".dlq") })

	ev, err := marshaler.NewMessage("order.placed", json.RawMessage(`{"order_id":42}`))
	require.NoError(t, err)
	pub, err := wmredis.NewPublisher(wmredis.PublisherConfig{Client: client, Marshaller: Marshaler{}}, watermill.NopLogger{})
	require.NoError(t, err)
	require.NoError(t, pub.Publish(stream, ev))

	plain := startUncountedRun(t, db, stream, "plain", false, 0)
	testenv.Eventually(t, 30*time.Second, "the plain client's delivery is held with an error naming CountingClient", func(o *testenv.Observed) bool {
		return o.Bool("held", plain.logs.heldForCountingClient())
	})
	plain.stop()
	require.Zero(t, plain.applied(), "an entry read without CountingClient must not reach the handler while the crash bound is on")
	pending, err := client.XPending(ctx, stream, "stock").Result()
	require.NoError(t, err)
	require.EqualValues(t, 1, pending.Count, "the held entry stays pending (never acked)")
	n, err := client.XLen(ctx, stream+".dlq").Result()
	require.NoError(t, err)
	require.Zero(t, n, "a wiring mistake must not dead-letter the event")

	counted := startUncountedRun(t, db, stream, "counted", true, 0)
	testenv.Eventually(t, 30*time.Second, "CountingClient's subscriber claims the held entry and applies it", func(o *testenv.Observed) bool {
		return o.Int("applied", counted.applied()) == 1
	})
	testenv.Eventually(t, 30*time.Second, "the applied entry is acked", func(o *testenv.Observed) bool {
		p, err := client.XPending(ctx, stream, "stock").Result()
		require.NoError(t, err)
		return o.Int("pending", int(p.Count)) == 0
	})
	counted.stop()
	require.Equal(t, 1, counted.applied())
	require.False(t, counted.logs.heldForCountingClient(), "CountingClient's deliveries are counted, never held for it")

	// The crash bound off: nothing to count, the plain client is served.
	ev2, err := marshaler.NewMessage("order.placed", json.RawMessage(`{"order_id":43}`))
	require.NoError(t, err)
	require.NoError(t, pub.Publish(stream, ev2))
	unbounded := startUncountedRun(t, db, stream, "unbounded", false, -1)
	testenv.Eventually(t, 30*time.Second, "without a crash bound the plain client's entry is applied", func(o *testenv.Observed) bool {
		return o.Int("applied", unbounded.applied()) == 1
	})
	require.False(t, unbounded.logs.heldForCountingClient())
}
