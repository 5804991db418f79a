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

// The keys that describe a delivery (the uncounted mark of an entry a
// plain client read; the redelivered flag and the delivery count of an
// entry claimed through CountingClient) belong to that delivery, not to
// the message: its dead-letter copy, published on a transport without an
// adapter to drop reserved keys (GoChannel, the watermill-sql subscriber),
// goes without them, so the dead-letter queue's own consumer does not take
// each of its attempts for a redelivery of the old message.
func TestPoisonCopyDoesNotCarryTheKeysOfTheDeliveryItCameFrom(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		// claimed: a consumer "dead" read the entry and never acked it, so
		// the subscriber (through CountingClient) claims it as a redelivery.
		claimed bool
		// seen: the delivery's keys the handler must see.
		seen message.Metadata
	}{
		{name: "plain_client", seen: message.Metadata{wire.UncountedDelivery: "true"}},
		{name: "claimed_through_counting_client", claimed: true,
			seen: message.Metadata{marshaler.MetadataRedelivered: "true", marshaler.MetadataDeliveryCount: "1"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			poisonCopyKeepsNoDeliveryKeys(t, tc.claimed, tc.seen)
		})
	}
}

func poisonCopyKeepsNoDeliveryKeys(t *testing.T, claimed bool, seenKeys message.Metadata) {
	ctx := context.Background()
	pool, _ := testenv.Pool(t)
	db := idempotency.Pgx(pool)
	require.NoError(t, processed.Migrate(ctx, db, processed.Config{}))
	raw, stream := rawStream(t, "poisoncopy")

	ev, err := marshaler.NewMessage("order.placed", json.RawMessage(`{"order_id":42}`))
	require.NoError(t, err)
	addEntry(t, raw, stream, ev, nil)
	client := redis.NewClient(&redis.Options{Addr: testenv.RedisAddr()})
	cfg := wmredis.SubscriberConfig{
		Client: client, Unmarshaller: Marshaler{}, // a plain client
		ConsumerGroup: "g", Consumer: "alive", OldestId: "0", BlockTime: 50 * time.Millisecond,
	}
	if claimed {
		require.NoError(t, raw.XGroupCreateMkStream(ctx, stream, "g", "0").Err())
		read, err := raw.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "g", Consumer: "dead", Streams: []string{stream, ">"}, Count: 1}).Result()
		require.NoError(t, err)
		require.Len(t, read[0].Messages, 1)
		cfg.Client = CountingClient(client)
		cfg.ClaimInterval, cfg.MaxIdleTime = 50*time.Millisecond, 100*time.Millisecond
	}

	dlq := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	t.Cleanup(func() { _ = dlq.Close() })
	copies, err := dlq.Subscribe(ctx, "dlq")
	require.NoError(t, err)

	sub, err := wmredis.NewSubscriber(cfg, watermill.NopLogger{})
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
		for k, v := range seenKeys {
			require.Equal(t, v, md.Get(k), "the handler's delivery carries %s", k)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the handler never ran")
	}
	select {
	case copy := <-copies:
		copy.Ack()
		require.Equal(t, ev.UUID, copy.UUID)
		for _, k := range []string{wire.UncountedDelivery, marshaler.MetadataRedelivered, marshaler.MetadataDeliveryCount} {
			require.NotContains(t, copy.Metadata, k, "the dead-letter copy must not carry the delivery's keys")
		}
		require.Equal(t, "order.placed", copy.Metadata.Get(marshaler.MetadataEventName), "the message's own keys are copied")
	case <-time.After(30 * time.Second):
		t.Fatal("no dead-letter copy")
	}
}
