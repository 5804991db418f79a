package kfaketest

import (
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	wmkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/watermill-idempotency/idempotency/internal/transporttest"
	"github.com/watermill-idempotency/idempotency/marshaler/kafka"
)

// TestKafkaContract runs the transport contract (internal/transporttest: a
// duplicate publish, a redelivery after a lost ack, a failure before
// commit, a malformed record, concurrent copies; each event's effect once,
// through a router, the recommended middleware chain and PostgreSQL) on
// watermill-kafka v3 and kfake. The connection-cut scenario is skipped:
// Kafka clients reach the brokers the metadata advertises, not a proxy in
// front of the bootstrap address.
func TestKafkaContract(t *testing.T) {
	t.Parallel()
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.AllowAutoTopicCreation(), kfake.DefaultNumPartitions(1))
	require.NoError(t, err)
	t.Cleanup(c.Close)
	brokers := c.ListenAddrs()
	transporttest.Run(t, kfakeTransport(brokers, 1))
}

// kfakeTransport is kfake as a transporttest.Transport: a topic of its own
// with partitions partitions per NewTopic, consumed by group <topic>_g.
func kfakeTransport(brokers []string, partitions int32) transporttest.Transport {
	var n atomic.Int32
	return transporttest.Transport{
		Name: "kafka-kfake",
		NewTopic: func(t *testing.T) transporttest.Topic {
			name := fmt.Sprintf("contract_%d_%s", n.Add(1), watermill.NewShortUUID())
			group := name + "_g"
			admin, err := sarama.NewClusterAdmin(brokers, saramaConfig())
			require.NoError(t, err)
			require.NoError(t, admin.CreateTopic(name, &sarama.TopicDetail{NumPartitions: partitions, ReplicationFactor: 1}, false))
			require.NoError(t, admin.Close())
			pub := newPublisher(t, brokers)
			producer, err := sarama.NewSyncProducer(brokers, func() *sarama.Config {
				c := sarama.NewConfig()
				c.Version = sarama.V2_1_0_0
				c.Producer.Return.Successes = true
				return c
			}())
			require.NoError(t, err)
			t.Cleanup(func() { _ = producer.Close() })
			return transporttest.Topic{
				Name:      name,
				Publisher: pub,
				NewSubscriber: func(t *testing.T, _ string) message.Subscriber {
					return groupSubscriber(t, brokers, group)
				},
				PublishRaw: func(t *testing.T, body []byte) {
					_, _, err := producer.SendMessage(&sarama.ProducerMessage{Topic: name, Value: sarama.ByteEncoder(body)})
					require.NoError(t, err)
				},
			}
		},
	}
}

func groupSubscriber(t *testing.T, brokers []string, group string) *wmkafka.Subscriber {
	t.Helper()
	sub, err := wmkafka.NewSubscriber(wmkafka.SubscriberConfig{
		Brokers: brokers, Unmarshaler: kafka.Marshaler{}, ConsumerGroup: group,
		OverwriteSaramaConfig: saramaConfig(),
	}, testLogger)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	return sub
}
