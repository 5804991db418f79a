package redisstream

import (
	"context"
	"encoding/json"
	"errors"
	"maps"
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
	"github.com/watermill-idempotency/idempotency/internal/wire"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
)

// The uncounted mark belongs to the delivery a plain client read, not to
// the message: the dead-letter copy of such an entry, published on a
// transport without an adapter to drop reserved keys (GoChannel, the
// watermill-sql subscriber), does not carry it, so the dead-letter
// queue's own consumer is not made to count every attempt.
func TestPoisonCopyOfAnUncountedEntryDoesNotCarryItsMark(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := testenv.Pool(t)
	db := idempotency.Pgx(pool)
	require.NoError(t, processed.Migrate(ctx, db, processed.Config{}))
	client, stream := rawStream(t, "poisoncopy")

	ev, err := marshaler.NewMessage("order.placed", json.RawMessage(`{"order_id":42}`))
	require.NoError(t, err)
	pub, err := wmredis.NewPublisher(wmredis.PublisherConfig{Client: client, Marshaller: Marshaler{}}, watermill.NopLogger{})
	require.NoError(t, err)
	require.NoError(t, pub.Publish(stream, ev))

	dlq := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	t.Cleanup(func() { _ = dlq.Close() })
	copies, err := dlq.Subscribe(ctx, "dlq")
	require.NoError(t, err)

	sub, err := wmredis.NewSubscriber(wmredis.SubscriberConfig{
		Client: redis.NewClient(&redis.Options{Addr: testenv.RedisAddr()}), Unmarshaller: Marshaler{}, // a plain client
		ConsumerGroup: "g", Consumer: "plain", OldestId: "0", BlockTime: 50 * time.Millisecond,
	}, watermill.NopLogger{})
	require.NoError(t, err)
	c, err := middleware.NewConsumer(middleware.ConsumerConfig{
		Consumer: "orders", DB: db,
		Poison: middleware.PoisonConfig{Publisher: dlq, Topic: "dlq"},
		Retry:  middleware.RetryConfig{InitialInterval: time.Millisecond, MaxInterval: 20 * time.Millisecond},
	}, nil)
	require.NoError(t, err)
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	seen := make(chan message.Metadata, 1)
	_, err = c.AddConsumerHandler(r, "reserve", stream, sub, func(msg *message.Message) error {
		select {
		case seen <- maps.Clone(msg.Metadata):
		default:
		}
		return middleware.Permanent(errors.New("out of stock"))
	})
	require.NoError(t, err)
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(rctx) }()
	<-r.Running()
	t.Cleanup(func() { cancel(); <-done; _ = sub.Close() })

	select {
	case md := <-seen:
		require.Equal(t, "true", md.Get(wire.UncountedDelivery), "the delivery read by a plain client is uncounted")
	case <-time.After(30 * time.Second):
		t.Fatal("the handler never ran")
	}
	select {
	case copy := <-copies:
		copy.Ack()
		require.Equal(t, ev.UUID, copy.UUID)
		require.NotContains(t, copy.Metadata, wire.UncountedDelivery, "the dead-letter copy must not carry the delivery's mark")
	case <-time.After(30 * time.Second):
		t.Fatal("no dead-letter copy")
	}
}
