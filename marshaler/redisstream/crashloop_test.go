package redisstream

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/crashlooptest"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

func init() { crashlooptest.Child(crashLoopWiring) }

func crashLoopWiring(logger watermill.LoggerAdapter) (crashlooptest.Wiring, error) {
	stream := os.Getenv("CRASHLOOP_REDIS_STREAM")
	client := CountingClient(redis.NewClient(&redis.Options{Addr: testenv.RedisAddr()}))
	sub, err := redisstream.NewSubscriber(redisstream.SubscriberConfig{
		Client: client, Unmarshaller: Marshaler{}, ConsumerGroup: "crashloop", OldestId: "0",
		// A dead consumer's pending entries are claimed a second later.
		MaxIdleTime: time.Second, ClaimInterval: 200 * time.Millisecond,
	}, logger)
	if err != nil {
		return crashlooptest.Wiring{}, err
	}
	poison, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: client, Marshaller: Marshaler{}}, logger)
	if err != nil {
		return crashlooptest.Wiring{}, err
	}
	return crashlooptest.Wiring{Subscriber: sub, Topic: stream, Poison: poison, PoisonTopic: stream + ".dlq"}, nil
}

// An event whose handler kills the consumer process is dead-lettered once,
// with a reason naming the crash loop, and the entries added before and
// after it are each applied once (issue 24). CountingClient's claims carry
// the pending list's delivery count: dead-lettered after MaxCrashes+1
// crashes, first reads write nothing. (A plain client's entries are held:
// TestEntriesReadWithoutCountingClientAreHeldUntilItWraps.)
func TestCrashLoopingEventIsDeadLetteredOnRedisStreams(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	client := redis.NewClient(&redis.Options{Addr: testenv.RedisAddr()})
	t.Cleanup(func() { _ = client.Close() })
	stream := testenv.UniqueName("crashloop")
	t.Cleanup(func() { client.Del(ctx, stream, stream+".dlq") })
	last := "-"
	crashlooptest.Run(t, crashlooptest.Transport{
		Marked: true,
		Env:    []string{"CRASHLOOP_REDIS_STREAM=" + stream},
		Publish: func(t testing.TB, msgs []*message.Message) {
			pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: client, Marshaller: Marshaler{}}, watermill.NopLogger{})
			require.NoError(t, err)
			require.NoError(t, pub.Publish(stream, msgs...))
		},
		DeadLetters: func(t testing.TB) []*message.Message {
			entries, err := client.XRange(ctx, stream+".dlq", last, "+").Result()
			require.NoError(t, err)
			var out []*message.Message
			for _, e := range entries {
				if e.ID == last {
					continue
				}
				last = e.ID
				msg, err := Marshaler{}.Unmarshal(e.Values)
				require.NoError(t, err)
				out = append(out, msg)
			}
			return out
		},
	})
}
