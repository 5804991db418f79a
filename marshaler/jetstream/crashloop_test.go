package jetstream

import (
	"errors"
	"os"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/crashlooptest"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

func init() { crashlooptest.Child(crashLoopWiring) }

func crashLoopWiring(logger watermill.LoggerAdapter) (crashlooptest.Wiring, error) {
	stream := os.Getenv("CRASHLOOP_JS_STREAM")
	sub, err := NewSubscriber(SubscriberConfig{
		URL: testenv.NATSURL(), Stream: stream, Durable: "crashloop",
		AckWait: time.Second, // a killed consumer's deliveries come back a second later
	}, logger)
	if err != nil {
		return crashlooptest.Wiring{}, err
	}
	poison, err := NewPublisher(PublisherConfig{URL: testenv.NATSURL()})
	if err != nil {
		return crashlooptest.Wiring{}, err
	}
	return crashlooptest.Wiring{Subscriber: sub, Topic: stream + ".events", Poison: poison, PoisonTopic: stream + ".dlq"}, nil
}

// An event whose handler kills the consumer process is dead-lettered once,
// with a reason naming the crash loop, after MaxCrashes+1 crashes
// (NumDelivered marks the redeliveries; the first crash is not counted),
// and the events published before and after it, delivered with it to the
// push subscription and redelivered after each crash with a growing
// NumDelivered though they never ran, are each applied once (issue 24).
func TestCrashLoopingEventIsDeadLetteredOnJetStream(t *testing.T) {
	t.Parallel()
	stream, js := testStream(t, testenv.NATSURL())
	dlq, err := js.SubscribeSync(stream+".dlq", nats.DeliverAll(), nats.AckNone())
	require.NoError(t, err)
	crashlooptest.Run(t, crashlooptest.Transport{
		Marked: true,
		Env:    []string{"CRASHLOOP_JS_STREAM=" + stream},
		Publish: func(t testing.TB, msgs []*message.Message) {
			pub, err := NewPublisher(PublisherConfig{URL: testenv.NATSURL()})
			require.NoError(t, err)
			defer pub.Close()
			require.NoError(t, pub.Publish(stream+".events", msgs...))
		},
		DeadLetters: func(t testing.TB) []*message.Message {
			var out []*message.Message
			for {
				nm, err := dlq.NextMsg(10 * time.Millisecond)
				if errors.Is(err, nats.ErrTimeout) {
					return out
				}
				require.NoError(t, err)
				msg, err := Marshaler{}.Unmarshal(nm)
				require.NoError(t, err)
				out = append(out, msg)
			}
		},
	})
}
