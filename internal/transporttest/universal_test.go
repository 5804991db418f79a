package transporttest_test

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	wmnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/tests"
	"github.com/nats-io/nats.go"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	amqpmarshaler "github.com/watermill-idempotency/idempotency/marshaler/amqp"
	"github.com/watermill-idempotency/idempotency/marshaler/jetstream"
	redismarshaler "github.com/watermill-idempotency/idempotency/marshaler/redisstream"
)

// The universal Pub/Sub suite of Watermill (pubsub/tests.TestPubSub) on each
// broker, with our marshaler in place of the transport's default and the
// Features each transport declares upstream, plus ForceShort (the suite's
// short message counts: each run stays under a minute on two cores) and no
// RestartServiceCommand (TestReconnect is skipped: the shared brokers are
// never restarted; TestJetStreamClusterLosesNodes and the contract's
// connection cuts cover reconnection).
//
// The suite publishes bare Watermill messages (a payload such as "x", no
// event name), which the envelope refuses by contract. suitePublisher makes
// each one an event (event_name and occurred_at set, the payload carried as
// a JSON string of its base64) and suiteSubscriber gives the payload back,
// in place, on the delivered message (its Ack and Nack are the
// transport's): UUIDs, metadata, acks, nacks, ordering and consumer groups
// all cross the broker through our marshaler.

const suiteEventName = "pubsub.suite"

type suitePublisher struct{ message.Publisher }

func (p suitePublisher) Publish(topic string, msgs ...*message.Message) error {
	out := make([]*message.Message, len(msgs))
	for i, m := range msgs {
		c := m.Copy()
		c.SetContext(m.Context())
		c.Metadata.Set(marshaler.MetadataEventName, suiteEventName)
		c.Metadata.Set(marshaler.MetadataOccurredAt, time.Now().UTC().Format(time.RFC3339Nano))
		var err error
		if c.Payload, err = json.Marshal(base64.StdEncoding.EncodeToString(m.Payload)); err != nil {
			return err
		}
		out[i] = c
	}
	return p.Publisher.Publish(topic, out...)
}

type suiteSubscriber struct {
	message.Subscriber
	closing   chan struct{}
	closeOnce sync.Once
	onTopic   func(topic string) // records what to clean up
	// forwarding counts the goroutines that feed Subscribe's channels:
	// Close returns once each has closed its channel, as the suite
	// expects of a closed subscriber (a non-blocking read right after
	// Close; seen failing in CI when Close returned first).
	forwarding sync.WaitGroup
}

func newSuiteSubscriber(sub message.Subscriber, onTopic func(string)) *suiteSubscriber {
	return &suiteSubscriber{Subscriber: sub, closing: make(chan struct{}), onTopic: onTopic}
}

func (s *suiteSubscriber) SubscribeInitialize(topic string) error {
	if s.onTopic != nil {
		s.onTopic(topic)
	}
	if init, ok := s.Subscriber.(message.SubscribeInitializer); ok {
		return init.SubscribeInitialize(topic)
	}
	return nil
}

func (s *suiteSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if s.onTopic != nil {
		s.onTopic(topic)
	}
	in, err := s.Subscriber.Subscribe(ctx, topic)
	if err != nil {
		return nil, err
	}
	out := make(chan *message.Message)
	s.forwarding.Add(1)
	go func() {
		defer s.forwarding.Done()
		defer close(out)
		for m := range in {
			if reason, bad := marshaler.Malformed(m); bad {
				m.Payload = []byte("malformed: " + reason)
			} else if marshaler.EventName(m) == suiteEventName {
				var text string
				if json.Unmarshal(m.Payload, &text) == nil {
					if raw, err := base64.StdEncoding.DecodeString(text); err == nil {
						m.Payload = raw
					}
				}
			}
			select {
			case out <- m:
			case <-s.closing:
				return
			}
		}
	}()
	return out, nil
}

func (s *suiteSubscriber) Close() error {
	s.closeOnce.Do(func() { close(s.closing) })
	err := s.Subscriber.Close() // closes the channels the goroutines range over
	s.forwarding.Wait()
	return err
}

// topics records the topics a suite run used, for its cleanup.
type topics struct {
	mu  sync.Mutex
	set map[string]bool
}

func (ts *topics) add(topic string) {
	ts.mu.Lock()
	defer ts.mu.Unlock()
	if ts.set == nil {
		ts.set = map[string]bool{}
	}
	ts.set[topic] = true
}

func (ts *topics) each(f func(string)) {
	ts.mu.Lock()
	defer ts.mu.Unlock()
	for topic := range ts.set {
		f(topic)
	}
}

// TestUniversalSuiteRabbitMQ: watermill-amqp v3's durable pub/sub
// (NewDurablePubSubConfig, publisher confirms) with amqp.Marshaler; the
// Features of watermill-amqp's own TestPublishSubscribe.
func TestUniversalSuiteRabbitMQ(t *testing.T) {
	t.Parallel()
	uri := testenv.AMQPURL()
	conn, err := amqp091.Dial(uri)
	require.NoError(t, err, "RabbitMQ at %s unreachable", uri)
	var used topics
	var queues sync.Map
	t.Cleanup(func() {
		defer conn.Close()
		ch, err := conn.Channel()
		if err != nil {
			return
		}
		defer ch.Close()
		queues.Range(func(q, _ any) bool { _, _ = ch.QueueDelete(q.(string), false, false, false); return true })
		used.each(func(topic string) { _ = ch.ExchangeDelete(topic, false, false) })
	})
	newPubSub := func(t *testing.T, suffix string) (message.Publisher, message.Subscriber) {
		queueName := wamqp.GenerateQueueNameTopicNameWithSuffix(suffix)
		pcfg := wamqp.NewDurablePubSubConfig(uri, nil)
		pcfg.Marshaler = amqpmarshaler.Marshaler{}
		pcfg.Publish.ConfirmDelivery = true
		pub, err := wamqp.NewPublisher(pcfg, watermill.NopLogger{})
		require.NoError(t, err)
		scfg := wamqp.NewDurablePubSubConfig(uri, queueName)
		scfg.Marshaler = amqpmarshaler.Marshaler{}
		sub, err := wamqp.NewSubscriber(scfg, watermill.NopLogger{})
		require.NoError(t, err)
		return suitePublisher{pub}, newSuiteSubscriber(sub, func(topic string) {
			used.add(topic)
			queues.Store(queueName(topic), true)
		})
	}
	tests.TestPubSub(t, tests.Features{
		ConsumerGroups:                      true,
		GuaranteedOrder:                     true,
		GuaranteedOrderWithSingleSubscriber: true,
		Persistent:                          true,
		ForceShort:                          true,
	},
		func(t *testing.T) (message.Publisher, message.Subscriber) { return newPubSub(t, "test") },
		newPubSub,
	)
}

// TestUniversalSuiteJetStream: watermill-nats v2's publisher with
// jetstream.Marshaler, and the recommended jetstream.Subscriber (one per
// Subscribe: a durable of its own without a consumer group, the group's
// durable with one; a stream per topic made by SubscribeInitialize, as
// upstream's AutoProvision false); the Features of watermill-nats' own
// TestPublishSubscribe ("normal": no TrackMsgId).
func TestUniversalSuiteJetStream(t *testing.T) {
	t.Parallel()
	url := testenv.NATSURL()
	nc, err := nats.Connect(url)
	require.NoError(t, err, "NATS at %s unreachable", url)
	js, err := nc.JetStream()
	require.NoError(t, err)
	var used topics
	t.Cleanup(func() {
		used.each(func(topic string) { _ = js.DeleteStream(suiteStream(topic)) })
		nc.Close()
	})
	newPubSub := func(t *testing.T, group string) (message.Publisher, message.Subscriber) {
		pub, err := wmnats.NewPublisher(wmnats.PublisherConfig{URL: url, Marshaler: jetstream.Marshaler{}}, watermill.NopLogger{})
		require.NoError(t, err)
		return suitePublisher{pub}, newSuiteSubscriber(&jsSuiteSubscriber{url: url, group: group, js: js}, used.add)
	}
	tests.TestPubSub(t, tests.Features{
		ConsumerGroups:                      true,
		GuaranteedOrder:                     true,
		GuaranteedOrderWithSingleSubscriber: true,
		Persistent:                          true,
		NewSubscriberReceivesOldMessages:    true,
		ForceShort:                          true,
	},
		func(t *testing.T) (message.Publisher, message.Subscriber) { return newPubSub(t, "") },
		newPubSub,
	)
}

func suiteStream(topic string) string {
	return strings.NewReplacer(".", "_", "*", "_", ">", "_").Replace(topic)
}

// jsSuiteSubscriber runs a jetstream.Subscriber per Subscribe call.
type jsSuiteSubscriber struct {
	url, group string
	js         nats.JetStreamContext

	mu   sync.Mutex
	subs []*jetstream.Subscriber
}

func (s *jsSuiteSubscriber) SubscribeInitialize(topic string) error {
	_, err := s.js.AddStream(&nats.StreamConfig{Name: suiteStream(topic), Subjects: []string{topic}})
	if err != nil && !strings.Contains(err.Error(), "already in use") {
		// AddStream of an identical config succeeds; another error is real.
		if _, infoErr := s.js.StreamInfo(suiteStream(topic)); infoErr != nil {
			return err
		}
	}
	return nil
}

func (s *jsSuiteSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	durable := s.group
	if durable == "" {
		durable = "d_" + strings.ReplaceAll(watermill.NewUUID(), "-", "")
	}
	sub, err := jetstream.NewSubscriber(jetstream.SubscriberConfig{
		URL: s.url, Stream: suiteStream(topic), Durable: durable,
		AckWait: 5 * time.Second, CloseTimeout: time.Second,
	}, watermill.NopLogger{})
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	s.subs = append(s.subs, sub)
	s.mu.Unlock()
	ch, err := sub.Subscribe(ctx, topic)
	if err != nil {
		return nil, fmt.Errorf("stream %s durable %s: %w", suiteStream(topic), durable, err)
	}
	return ch, nil
}

func (s *jsSuiteSubscriber) Close() error {
	s.mu.Lock()
	subs := s.subs
	s.subs = nil
	s.mu.Unlock()
	var wg sync.WaitGroup
	for _, sub := range subs {
		wg.Add(1)
		go func() { defer wg.Done(); _ = sub.Close() }()
	}
	wg.Wait()
	return nil
}

// TestUniversalSuiteRedisStreams: watermill-redisstream with
// redisstream.Marshaler, configured like watermill-redisstream's own
// TestPublishSubscribe (a random consumer group without one), with its
// Features.
func TestUniversalSuiteRedisStreams(t *testing.T) {
	t.Parallel()
	addr := testenv.RedisAddr()
	client := redis.NewClient(&redis.Options{Addr: addr})
	require.NoError(t, client.Ping(context.Background()).Err(), "Redis at %s unreachable", addr)
	var used topics
	t.Cleanup(func() {
		used.each(func(topic string) { _ = client.Del(context.Background(), topic).Err() })
		_ = client.Close()
	})
	newPubSub := func(t *testing.T, group string) (message.Publisher, message.Subscriber) {
		// Their Close closes the client: one each.
		pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: redis.NewClient(&redis.Options{Addr: addr}), Marshaller: redismarshaler.Marshaler{}}, watermill.NopLogger{})
		require.NoError(t, err)
		sub, err := redisstream.NewSubscriber(redisstream.SubscriberConfig{
			Client: redismarshaler.CountingClient(redis.NewClient(&redis.Options{Addr: addr})), Unmarshaller: redismarshaler.Marshaler{},
			Consumer: watermill.NewShortUUID(), ConsumerGroup: group,
			BlockTime: 10 * time.Millisecond, ClaimInterval: 3 * time.Second, MaxIdleTime: 5 * time.Second,
		}, watermill.NopLogger{})
		require.NoError(t, err)
		return suitePublisher{pub}, newSuiteSubscriber(sub, used.add)
	}
	tests.TestPubSub(t, tests.Features{
		ConsumerGroups:                      true,
		GuaranteedOrderWithSingleSubscriber: true,
		Persistent:                          true,
		NewSubscriberReceivesOldMessages:    true,
		ForceShort:                          true,
	},
		func(t *testing.T) (message.Publisher, message.Subscriber) {
			return newPubSub(t, watermill.NewShortUUID())
		},
		newPubSub,
	)
}
