package kfaketest

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	wmkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/marshaler/kafka"
)

const topic = "orders"

var testLogger watermill.LoggerAdapter = watermill.NopLogger{}

// cluster starts an in-process Kafka (one broker) with topic in partitions.
func cluster(t *testing.T, partitions int32) []string {
	t.Helper()
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(partitions, topic))
	require.NoError(t, err)
	t.Cleanup(c.Close)
	return c.ListenAddrs()
}

func saramaConfig() *sarama.Config {
	c := wmkafka.DefaultSaramaSubscriberConfig()
	c.Version = sarama.V2_1_0_0
	c.Consumer.Offsets.Initial = sarama.OffsetOldest
	// Offsets are committed at each ack (watermill-kafka commits explicitly
	// when auto-commit is off): what is not acked is consumed again.
	c.Consumer.Offsets.AutoCommit.Enable = false
	c.Consumer.Group.Heartbeat.Interval = 100 * time.Millisecond
	c.Consumer.Group.Session.Timeout = 6 * time.Second
	c.Consumer.Group.Rebalance.Timeout = 2 * time.Second
	c.Consumer.Group.Rebalance.Retry.Backoff = 100 * time.Millisecond
	c.Metadata.RefreshFrequency = time.Second
	return c
}

func newSubscriber(t *testing.T, brokers []string) *wmkafka.Subscriber {
	t.Helper()
	sub, err := wmkafka.NewSubscriber(wmkafka.SubscriberConfig{
		Brokers: brokers, Unmarshaler: kafka.Marshaler{}, ConsumerGroup: "stock",
		OverwriteSaramaConfig: saramaConfig(),
	}, testLogger)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	return sub
}

func newPublisher(t *testing.T, brokers []string) *wmkafka.Publisher {
	t.Helper()
	pc := wmkafka.DefaultSaramaSyncPublisherConfig()
	pc.Version = sarama.V2_1_0_0
	pub, err := wmkafka.NewPublisher(wmkafka.PublisherConfig{
		Brokers: brokers, Marshaler: kafka.Marshaler{PartitionKey: func(_ string, msg *message.Message) (string, error) {
			return msg.Metadata.Get("key"), nil
		}},
		OverwriteSaramaConfig: pc,
	}, watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	return pub
}

func event(t *testing.T, key string) *message.Message {
	t.Helper()
	msg, err := marshaler.NewMessage("order.placed", map[string]string{"key": key})
	require.NoError(t, err)
	msg.Metadata.Set("key", key)
	return msg
}

func receive(t *testing.T, ch <-chan *message.Message) *message.Message {
	t.Helper()
	select {
	case msg := <-ch:
		require.NotNil(t, msg, "subscription closed")
		return msg
	case <-time.After(30 * time.Second):
		t.Fatal("no message within 30 s")
		return nil
	}
}

// TestKafkaPoisonRecordDoesNotBlockPartition: a record that is no envelope
// (a foreign producer's) is delivered flagged malformed, its offset is
// committed when it is acked (the middleware dead-letters and acks it), and
// the next event of the partition follows. watermill-kafka ends the session
// on an Unmarshal error and the partition would be stuck on that record.
func TestKafkaPoisonRecordDoesNotBlockPartition(t *testing.T) {
	t.Parallel()
	brokers := cluster(t, 1)
	producer, err := sarama.NewSyncProducer(brokers, func() *sarama.Config {
		c := sarama.NewConfig()
		c.Version = sarama.V2_1_0_0
		c.Producer.Return.Successes = true
		return c
	}())
	require.NoError(t, err)
	defer producer.Close()
	_, _, err = producer.SendMessage(&sarama.ProducerMessage{Topic: topic, Value: sarama.StringEncoder("not json")})
	require.NoError(t, err)
	good := event(t, "k")
	require.NoError(t, newPublisher(t, brokers).Publish(topic, good))

	ch, err := newSubscriber(t, brokers).Subscribe(context.Background(), topic)
	require.NoError(t, err)
	bad := receive(t, ch)
	_, malformed := marshaler.Malformed(bad)
	require.True(t, malformed)
	require.Equal(t, "not json", string(bad.Payload))
	bad.Ack()
	got := receive(t, ch)
	require.Equal(t, good.UUID, got.UUID)
	got.Ack()
}

// TestKafkaMemberClosedBeforeCommitRedelivers: a member closed while it
// holds an event (not acked, its offset not committed) leaves it to the
// next member of the group, which gets it again; the acked event before it
// is not redelivered.
func TestKafkaMemberClosedBeforeCommitRedelivers(t *testing.T) {
	t.Parallel()
	brokers := cluster(t, 1)
	pub := newPublisher(t, brokers)
	first, second := event(t, "k"), event(t, "k")
	require.NoError(t, pub.Publish(topic, first, second))

	a := newSubscriber(t, brokers)
	chA, err := a.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	got := receive(t, chA)
	require.Equal(t, first.UUID, got.UUID)
	got.Ack()
	held := receive(t, chA)
	require.Equal(t, second.UUID, held.UUID)
	require.NoError(t, a.Close()) // before the ack: the offset stays at second
	held.Ack()                    // too late: the session is over

	chB, err := newSubscriber(t, brokers).Subscribe(context.Background(), topic)
	require.NoError(t, err)
	again := receive(t, chB)
	require.Equal(t, second.UUID, again.UUID, "the uncommitted event comes again, the committed one does not")
	again.Ack()
}

// TestKafkaRebalanceDuringProcessing: a second member joins while the first
// holds an event; every event is delivered and acked across the rebalance,
// none is lost (an event whose partition moved before its ack is delivered
// again: the consumer's claim keeps its effect single). Two partitions, keys
// spread over both.
func TestKafkaRebalanceDuringProcessing(t *testing.T) {
	t.Parallel()
	brokers := cluster(t, 2)
	pub := newPublisher(t, brokers)
	var sent []*message.Message
	for _, key := range []string{"a", "b", "c", "d", "e", "f"} {
		sent = append(sent, event(t, key))
	}
	require.NoError(t, pub.Publish(topic, sent...))

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	seen := map[string]int{}
	a := newSubscriber(t, brokers)
	chA, err := a.Subscribe(ctx, topic)
	require.NoError(t, err)
	held := receive(t, chA) // held through the rebalance
	seen[held.UUID]++

	chB, err := newSubscriber(t, brokers).Subscribe(ctx, topic)
	require.NoError(t, err)
	deadline := time.After(60 * time.Second)
	acked := map[string]bool{}
	for len(acked) < len(sent) {
		select {
		case m := <-chA:
			seen[m.UUID]++
			acked[m.UUID] = true
			m.Ack()
		case m := <-chB:
			seen[m.UUID]++
			acked[m.UUID] = true
			m.Ack()
		case <-deadline:
			t.Fatalf("after 60 s: %d of %d events acked, seen %v", len(acked), len(sent), seen)
		}
		if len(acked) > 0 && !acked[held.UUID] {
			// Released once B is in the group: if the rebalance moved its
			// partition, the ack commits nothing and the event comes again.
			held.Ack()
			acked[held.UUID] = true
		}
	}
	for _, m := range sent {
		require.GreaterOrEqual(t, seen[m.UUID], 1, m.UUID)
	}
}

// failingUnmarshaler returns an error where kafka.Marshaler flags a record
// malformed: what an ordinary Unmarshaler does.
type failingUnmarshaler struct{ kafka.Marshaler }

func (f failingUnmarshaler) Unmarshal(rec *sarama.ConsumerMessage) (*message.Message, error) {
	msg, _ := f.Marshaler.Unmarshal(rec)
	if reason, bad := marshaler.Malformed(msg); bad {
		return nil, errors.New(reason)
	}
	return msg, nil
}

// TestWatermillKafkaStuckOnUnmarshalError pins the trap the adapter avoids:
// watermill-kafka v3 ends the group session on an Unmarshal error, consumes
// the partition again from the same offset, fails again: the event behind
// the foreign record never arrives.
func TestWatermillKafkaStuckOnUnmarshalError(t *testing.T) {
	t.Parallel()
	brokers := cluster(t, 1)
	producer, err := sarama.NewSyncProducer(brokers, func() *sarama.Config {
		c := sarama.NewConfig()
		c.Version = sarama.V2_1_0_0
		c.Producer.Return.Successes = true
		return c
	}())
	require.NoError(t, err)
	defer producer.Close()
	_, _, err = producer.SendMessage(&sarama.ProducerMessage{Topic: topic, Value: sarama.StringEncoder("not json")})
	require.NoError(t, err)
	require.NoError(t, newPublisher(t, brokers).Publish(topic, event(t, "k")))

	sub, err := wmkafka.NewSubscriber(wmkafka.SubscriberConfig{
		Brokers: brokers, Unmarshaler: failingUnmarshaler{}, ConsumerGroup: "stock",
		OverwriteSaramaConfig: saramaConfig(), ReconnectRetrySleep: 100 * time.Millisecond,
	}, testLogger)
	require.NoError(t, err)
	defer sub.Close()
	ch, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	select {
	case m := <-ch:
		t.Fatalf("received %s past the foreign record", m.UUID)
	case <-time.After(3 * time.Second):
	}
}
