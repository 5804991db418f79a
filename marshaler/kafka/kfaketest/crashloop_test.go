package kfaketest

import (
	"os"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	wmkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/watermill-idempotency/idempotency/internal/crashlooptest"
	"github.com/watermill-idempotency/idempotency/marshaler/kafka"
)

const (
	crashLoopTopic = "crashloop"
	crashLoopDLQ   = "crashloop.dlq"
)

func init() { crashlooptest.Child(crashLoopWiring) }

// crashLoopSaramaConfig: offsets marked at each ack and auto-committed
// (docs/transports.md), so a killed member's successor resumes at or before
// the record that killed it (never acked, never marked).
func crashLoopSaramaConfig() *sarama.Config {
	c := wmkafka.DefaultSaramaSubscriberConfig()
	c.Version = sarama.V2_1_0_0
	c.Consumer.Offsets.Initial = sarama.OffsetOldest
	c.Consumer.Offsets.AutoCommit.Enable = true
	c.Consumer.Offsets.AutoCommit.Interval = 200 * time.Millisecond
	c.Consumer.Group.Heartbeat.Interval = 100 * time.Millisecond
	c.Consumer.Group.Session.Timeout = 6 * time.Second
	c.Consumer.Group.Rebalance.Timeout = 2 * time.Second
	c.Consumer.Group.Rebalance.Retry.Backoff = 100 * time.Millisecond
	c.Metadata.RefreshFrequency = time.Second
	return c
}

func crashLoopPublisher(brokers []string, logger watermill.LoggerAdapter) (*wmkafka.Publisher, error) {
	pc := wmkafka.DefaultSaramaSyncPublisherConfig()
	pc.Version = sarama.V2_1_0_0
	return wmkafka.NewPublisher(wmkafka.PublisherConfig{Brokers: brokers, Marshaler: kafka.Marshaler{}, OverwriteSaramaConfig: pc}, logger)
}

func crashLoopWiring(logger watermill.LoggerAdapter) (crashlooptest.Wiring, error) {
	brokers := strings.Split(os.Getenv("CRASHLOOP_KAFKA_BROKERS"), ",")
	sub, err := wmkafka.NewSubscriber(wmkafka.SubscriberConfig{
		Brokers: brokers, Unmarshaler: kafka.Marshaler{}, ConsumerGroup: "crashloop",
		OverwriteSaramaConfig: crashLoopSaramaConfig(),
	}, logger)
	if err != nil {
		return crashlooptest.Wiring{}, err
	}
	poison, err := crashLoopPublisher(brokers, logger)
	if err != nil {
		return crashlooptest.Wiring{}, err
	}
	return crashlooptest.Wiring{Subscriber: sub, Topic: crashLoopTopic, Poison: poison, PoisonTopic: crashLoopDLQ}, nil
}

// An event whose handler kills the consumer process is dead-lettered once,
// with a reason naming the crash loop, after MaxCrashes crashes (Kafka
// marks no redelivery: each restarted member's first attempts are counted,
// and the record that killed the last one is among them, since the group
// resumes at its uncommitted offset), and the records before and after it
// in the partition are each applied once (issue 24). The members are child
// processes connected to a kfake cluster this test runs on a loopback port.
func TestCrashLoopingEventIsDeadLetteredOnKafka(t *testing.T) {
	t.Parallel()
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, crashLoopTopic, crashLoopDLQ))
	require.NoError(t, err)
	t.Cleanup(c.Close)
	brokers := c.ListenAddrs()

	consumer, err := sarama.NewConsumer(brokers, crashLoopSaramaConfig())
	require.NoError(t, err)
	t.Cleanup(func() { _ = consumer.Close() })
	dlq, err := consumer.ConsumePartition(crashLoopDLQ, 0, sarama.OffsetOldest)
	require.NoError(t, err)
	t.Cleanup(func() { _ = dlq.Close() })

	crashlooptest.Run(t, crashlooptest.Transport{
		Env: []string{"CRASHLOOP_KAFKA_BROKERS=" + strings.Join(brokers, ",")},
		Publish: func(t testing.TB, msgs []*message.Message) {
			pub, err := crashLoopPublisher(brokers, watermill.NopLogger{})
			require.NoError(t, err)
			defer pub.Close()
			require.NoError(t, pub.Publish(crashLoopTopic, msgs...))
		},
		DeadLetters: func(t testing.TB) []*message.Message {
			var out []*message.Message
			for {
				select {
				case rec := <-dlq.Messages():
					msg, err := kafka.Marshaler{}.Unmarshal(rec)
					require.NoError(t, err)
					out = append(out, msg)
				default:
					return out
				}
			}
		},
	})
}
