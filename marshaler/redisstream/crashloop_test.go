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
	var client redis.UniversalClient = redis.NewClient(&redis.Options{Addr: testenv.RedisAddr()})
	if os.Getenv("CRASHLOOP_REDIS_COUNTING") == "true" {
		client = CountingClient(client)
	}
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
// after it are each applied once (issue 24). With CountingClient the claims
// carry the pending list's delivery count: dead-lettered after MaxCrashes+1
// crashes, first reads write nothing. A plain client cannot tell a first
// read from a claim: every attempt is counted, and the event is
// dead-lettered after MaxCrashes crashes, also under a steady producer
// whose new entries each restarted consumer reads (more than the 64
// attempts a start counts on a transport that marks nothing) before it
// claims the pending killer: before, that loop never ended.
func TestCrashLoopingEventIsDeadLetteredOnRedisStreams(t *testing.T) {
	t.Parallel()
	for _, counting := range []bool{true, false} {
		t.Run(map[bool]string{true: "counting_client", false: "plain_client_steady_producer"}[counting], func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			client := redis.NewClient(&redis.Options{Addr: testenv.RedisAddr()})
			t.Cleanup(func() { _ = client.Close() })
			stream := testenv.UniqueName("crashloop")
			t.Cleanup(func() { client.Del(ctx, stream, stream+".dlq") })
			last := "-"
			newPerChild := 0
			if !counting {
				newPerChild = 80
			}
			crashlooptest.Run(t, crashlooptest.Transport{
				Marked:      counting,
				NewPerChild: newPerChild,
				Env:         []string{"CRASHLOOP_REDIS_STREAM=" + stream, "CRASHLOOP_REDIS_COUNTING=" + map[bool]string{true: "true", false: "false"}[counting]},
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
		})
	}
}
