package kfaketest

import (
	"strings"
	"testing"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/watermill-idempotency/idempotency/internal/crashlooptest"
	"github.com/watermill-idempotency/idempotency/marshaler/kafka"
)

// The crash-loop scenario as it happens in production: the poisoned record
// reaches a consumer that has been running for a while (here: it applied
// three events and skipped 70 redelivered copies of one of them, i.e. 73
// attempts, past the 64-attempt warm-up) before the poison arrives.
// guarantees.md: "After ConsumerConfig.MaxCrashes (3) such attempts died
// the next delivery is dead-lettered … the MaxCrashes+1st on Kafka";
// transports.md's table: Kafka "dead-lettered at delivery MaxCrashes+1".
// crashlooptest.Run checks at most MaxCrashes crashes for an unmarked
// transport.
func TestCrashLoopOnKafkaBoundedWhenThePoisonReachesAWarmConsumer(t *testing.T) {
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
			// Three events, then 70 copies of the first (a relay's
			// republishes: duplicates, each an attempt), then the poison
			// and the rest: the first member is warm when the poison comes.
			all := append([]*message.Message{}, msgs[:3]...)
			for i := 0; i < 70; i++ {
				all = append(all, msgs[0].Copy())
			}
			all = append(all, msgs[3:]...)
			require.NoError(t, pub.Publish(crashLoopTopic, all...))
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
