package redisstream

import (
	"context"
	"encoding/json"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
)

// A Subscriber left with watermill-redisstream's default unmarshaller (the
// wiring mistake docs/consumer.md's error classes describe: "a message no
// envelope adapter decoded … held like transient, with an ERROR log saying
// what to fix") must not run the handler on the envelope. Our Marshaler
// writes _watermill_message_uuid (the event id) and the metadata field, so
// the default unmarshaller yields a message with the event's UUID and
// event_name whose payload is the whole envelope
// ({"event_id":…,"payload":{…}}). Before this test the consumer claimed it
// and ran the handler on that envelope: the effect was applied with the
// wrong input and the claim recorded, so fixing the subscriber afterwards
// skips the event as a duplicate (or refuses it as ErrEventIDReused, the
// fingerprint being the envelope's). The handler must either not run (the
// delivery held as a configuration error) or see the event's own payload.
func TestDefaultUnmarshallerSubscriberNeverRunsTheHandlerOnTheEnvelope(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := testenv.Pool(t)
	require.NoError(t, processed.Migrate(ctx, idempotency.Pgx(pool), processed.Config{}))

	client := redis.NewClient(&redis.Options{Addr: testenv.RedisAddr()})
	t.Cleanup(func() { _ = client.Close() })
	stream := testenv.UniqueName("defunm")
	t.Cleanup(func() { client.Del(context.Background(), stream, stream+".dlq") })
	pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: client, Marshaller: Marshaler{}}, watermill.NopLogger{})
	require.NoError(t, err)
	sub, err := redisstream.NewSubscriber(redisstream.SubscriberConfig{
		Client:        client,
		Unmarshaller:  redisstream.DefaultMarshallerUnmarshaller{}, // the mistake
		ConsumerGroup: "stock", OldestId: "0",
	}, watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })

	c, err := middleware.NewConsumer(middleware.ConsumerConfig{
		Consumer: "stock", DB: idempotency.Pgx(pool),
		Poison: middleware.PoisonConfig{Publisher: pub, Topic: stream + ".dlq"},
		Retry:  middleware.RetryConfig{InitialInterval: time.Millisecond, MaxInterval: 5 * time.Millisecond},
	}, watermill.NopLogger{})
	require.NoError(t, err)
	r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	require.NoError(t, err)
	var mu sync.Mutex
	var seen []string
	_, err = c.AddConsumerHandler(r, "reserve", stream, sub, func(msg *message.Message) error {
		mu.Lock()
		defer mu.Unlock()
		seen = append(seen, string(msg.Payload))
		return nil
	})
	require.NoError(t, err)
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(runCtx) }()
	t.Cleanup(func() { cancel(); <-done })
	<-r.Running()

	ev, err := marshaler.NewMessage("order.placed", json.RawMessage(`{"order_id":42}`))
	require.NoError(t, err)
	require.NoError(t, pub.Publish(stream, ev))

	deadline := time.Now().Add(3 * time.Second)
	for time.Now().Before(deadline) {
		mu.Lock()
		n := len(seen)
		mu.Unlock()
		if n > 0 {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	mu.Lock()
	for _, p := range seen {
		require.JSONEq(t, `{"order_id":42}`, p,
			"the handler ran (and the claim committed) on a message whose payload is not the event's: the subscriber's default unmarshaller left the envelope undecoded")
	}
	mu.Unlock()
	// Held, not dropped: delivered to the group and never acked, nothing
	// claimed, nothing on the poison stream.
	pending, err := client.XPending(ctx, stream, "stock").Result()
	require.NoError(t, err)
	require.EqualValues(t, 1, pending.Count, "the entry must have been delivered and stay unacked (held)")
	var claimed int
	require.NoError(t, pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM processed_event WHERE consumer = 'stock' AND event_id = $1)
		+ (SELECT count(*) FROM processed_event_v7 v JOIN processed_event_consumer c ON c.id = v.consumer WHERE c.name = 'stock' AND v.event_id = $1)`, ev.UUID).Scan(&claimed))
	require.Zero(t, claimed, "the event must not be claimed while its payload is the envelope")
	n, err := client.XLen(ctx, stream+".dlq").Result()
	require.NoError(t, err)
	require.Zero(t, n, "a wiring mistake must not dead-letter the event")
}
