package redisstream

import (
	"context"
	"encoding/json"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmredis "github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
)

// One live subscriber, nobody dies, an attempt (with its retries) longer
// than MaxIdleTime: watermill-redisstream's claim loop XCLAIMs any entry
// idle that long, the one its own subscriber is still handling included,
// so the handler ran the event a second time and a permanent failure was
// dead-lettered twice (guarantees.md: "sent once"). CountingClient restarts
// the idle time of the entries it handed out and that are not acked yet
// before each listing: the entry is handled once and dead-lettered once.
func TestLiveEntryIsNotClaimedBackWhileItsAttemptRuns(t *testing.T) {
	selfClaim(t, true)
}

// The same with an attempt that succeeds: applied once, nothing
// dead-lettered.
func TestSlowSuccessfulAttemptIsAppliedOnce(t *testing.T) {
	selfClaim(t, false)
}

func selfClaim(t *testing.T, fail bool) {
	ctx := context.Background()
	pool, _ := testenv.Pool(t)
	db := idempotency.Pgx(pool)
	require.NoError(t, processed.Migrate(ctx, db, processed.Config{}))
	raw, stream := rawStream(t, "live-entry-claim")

	ev, err := marshaler.NewMessage("order.placed", json.RawMessage(`{"order_id":7}`))
	require.NoError(t, err)
	addEntry(t, raw, stream, ev, nil)

	client := redis.NewClient(&redis.Options{Addr: testenv.RedisAddr()})
	sub, err := wmredis.NewSubscriber(wmredis.SubscriberConfig{
		Client: CountingClient(client), Unmarshaller: Marshaler{},
		ConsumerGroup: "g", Consumer: "alive", OldestId: "0", BlockTime: 50 * time.Millisecond,
		MaxIdleTime: 500 * time.Millisecond, ClaimInterval: 100 * time.Millisecond,
	}, watermill.NopLogger{})
	require.NoError(t, err)

	dlq := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	t.Cleanup(func() { _ = dlq.Close() })
	copies, err := dlq.Subscribe(ctx, "dlq")
	require.NoError(t, err)

	c, err := middleware.NewConsumer(middleware.ConsumerConfig{
		Consumer: testenv.UniqueName("orders"), DB: db,
		Poison: middleware.PoisonConfig{Publisher: dlq, Topic: "dlq"},
		Retry:  middleware.RetryConfig{MaxRetries: 1, InitialInterval: time.Millisecond, MaxInterval: time.Millisecond},
	}, nil)
	require.NoError(t, err)
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	var runs atomic.Int32
	_, err = c.AddConsumerHandler(r, "reserve", stream, sub, func(msg *message.Message) error {
		runs.Add(1)
		time.Sleep(time.Second) // a slow attempt: longer than MaxIdleTime
		if !fail {
			return nil
		}
		return middleware.Permanent(errors.New("out of stock"))
	})
	require.NoError(t, err)
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(rctx) }()
	<-r.Running()
	t.Cleanup(func() { cancel(); <-done; _ = sub.Close() })

	var dead int
	deadline := time.After(4 * time.Second)
loop:
	for {
		select {
		case m := <-copies:
			m.Ack()
			dead++
		case <-deadline:
			break loop
		}
	}
	pending, err := raw.XPending(ctx, stream, "g").Result()
	require.NoError(t, err)
	require.Zero(t, pending.Count, "the entry is acked")
	t.Logf("handler runs: %d, dead letters: %d", runs.Load(), dead)
	if !fail {
		require.Zero(t, dead)
		require.Equal(t, int32(1), runs.Load(), "applied once")
		return
	}
	require.Equal(t, 1, dead, "one entry, no process died: dead-lettered once")
	require.Equal(t, int32(1), runs.Load(), "one entry, no process died: a permanent failure runs the handler once")
}
