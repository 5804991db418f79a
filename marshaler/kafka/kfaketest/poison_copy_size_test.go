package kfaketest

import (
	"bytes"
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	wmkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler/kafka"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
)

// A foreign record that fits the producer's and the broker's limits (1 MiB:
// sarama's Producer.MaxMessageBytes default, which watermill-kafka's
// publisher keeps) but whose dead-letter copy does not (the body plus a
// few hundred bytes of poison headers) is dead-lettered once without its
// payload, and the partition moves on: before, every publish of the copy
// failed, the record was held and resent in process, and every later
// record of its partition waited for ever.
func TestRecordWhoseDeadLetterCopyIsOverTheProducersLimitDoesNotBlockItsPartition(t *testing.T) {
	kc, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, topic, topic+".dlq"))
	require.NoError(t, err)
	t.Cleanup(kc.Close)
	brokers := kc.ListenAddrs()
	producer, err := sarama.NewSyncProducer(brokers, func() *sarama.Config {
		c := sarama.NewConfig()
		c.Version = sarama.V2_1_0_0
		c.Producer.Return.Successes = true
		return c
	}())
	require.NoError(t, err)
	defer producer.Close()
	// A foreign producer's record: not an envelope, 1,048,000 bytes (under
	// the 1 MiB limit of the producer and the broker; at 999,900 bytes the
	// copy fits and is dead-lettered once, the next event applied).
	_, _, err = producer.SendMessage(&sarama.ProducerMessage{Topic: topic, Value: sarama.ByteEncoder(bytes.Repeat([]byte("x"), 1_048_000))})
	require.NoError(t, err)
	good := event(t, "k")
	require.NoError(t, newPublisher(t, brokers).Publish(topic, good))

	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	require.NoError(t, processed.Migrate(ctx, idempotency.Pgx(pool), processed.Config{}))

	poisonCfg := wmkafka.DefaultSaramaSyncPublisherConfig()
	poisonCfg.Version = sarama.V2_1_0_0
	poison, err := wmkafka.NewPublisher(wmkafka.PublisherConfig{Brokers: brokers, Marshaler: kafka.Marshaler{}, OverwriteSaramaConfig: poisonCfg}, watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = poison.Close() })
	c, err := middleware.NewConsumer(middleware.ConsumerConfig{
		Consumer: "dl_copy_size", DB: idempotency.Pgx(pool),
		Poison: middleware.PoisonConfig{Publisher: poison, Topic: topic + ".dlq"},
		Retry:  middleware.RetryConfig{InitialInterval: 50 * time.Millisecond, MaxInterval: 200 * time.Millisecond, MaxHold: time.Second},
	}, watermill.NopLogger{})
	require.NoError(t, err)
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	require.NoError(t, err)
	var applied atomic.Int32
	_, err = c.AddConsumerHandler(router, "dl_copy_size", topic, newSubscriber(t, brokers), func(msg *message.Message) error {
		if msg.UUID == good.UUID {
			applied.Add(1)
		}
		return nil
	})
	require.NoError(t, err)
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = router.Run(rctx) }()
	t.Cleanup(func() { cancel(); <-done })
	<-router.Running()

	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) && applied.Load() == 0 {
		time.Sleep(200 * time.Millisecond)
	}
	dead := len(records(t, brokers, topic+".dlq"))
	t.Logf("dead letters: %d, good event applied: %d", dead, applied.Load())
	require.Equal(t, int32(1), applied.Load(), "the event behind the foreign record must be applied, not wait for ever")
	require.Equal(t, 1, dead, "the foreign record is dead-lettered once (without its payload)")
}
