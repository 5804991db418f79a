package amqp_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	idamqp "github.com/watermill-idempotency/idempotency/marshaler/amqp"
)

// layout is one way of configuring a watermill-amqp consumer.
type layout struct {
	name string
	// config returns the consumer's subscriber (and producer) configuration
	// on names derived from prefix, and the queue it consumes.
	config func(prefix string, quorum bool) (cfg wamqp.Config, topic, queue string)
}

func quorumArgs(quorum bool) amqp091.Table {
	if quorum {
		return amqp091.Table{"x-queue-type": "quorum"}
	}
	return nil
}

var layouts = []layout{
	{"queue", func(prefix string, quorum bool) (wamqp.Config, string, string) {
		cfg := wamqp.NewDurableQueueConfig(testenv.AMQPURL())
		cfg.Queue.Arguments = quorumArgs(quorum)
		topic := prefix + "stock"
		return cfg, topic, topic
	}},
	{"topic", func(prefix string, quorum bool) (wamqp.Config, string, string) {
		queue := prefix + "stock.events"
		cfg := wamqp.NewDurableTopicConfig(testenv.AMQPURL(), prefix+"events", queue)
		cfg.Queue.Arguments = quorumArgs(quorum)
		return cfg, "order.placed", queue
	}},
	{"pubsub", func(prefix string, quorum bool) (wamqp.Config, string, string) {
		cfg := wamqp.NewDurablePubSubConfig(testenv.AMQPURL(), wamqp.GenerateQueueNameTopicNameWithSuffix("stock"))
		cfg.Queue.Arguments = quorumArgs(quorum)
		topic := prefix + "order.placed"
		return cfg, topic, topic + "_stock"
	}},
}

// rig is one consumer on the real broker whose handler fails permanently
// on "bad" events; Watermill's PoisonQueue middleware publishes them with
// the poison publisher.
type rig struct {
	t      *testing.T
	prefix string // of every broker name of the test
	conn   *amqp091.Connection
	cfg    wamqp.Config
	topic  string
	queue  string
	mu     sync.Mutex
	calls  map[string]int // event id → handler calls
	order  []string
	router *message.Router
}

func newRig(t *testing.T, l layout, quorum bool) *rig {
	t.Helper()
	prefix := testenv.UniqueName("dlq") + "."
	cfg, topic, queue := l.config(prefix, quorum)
	cfg.Marshaler = idamqp.Marshaler{}
	conn, err := amqp091.Dial(testenv.AMQPURL())
	require.NoError(t, err, "RabbitMQ at %s unreachable (start it: rabbitmq-server -detached)", testenv.AMQPURL())
	r := &rig{t: t, prefix: prefix, conn: conn, cfg: cfg, topic: topic, queue: queue, calls: map[string]int{}}
	t.Cleanup(func() {
		// A fresh channel per deletion: a failed one closes its channel.
		for _, q := range []string{queue, prefix + "dlq"} {
			if ch, err := conn.Channel(); err == nil {
				_, _ = ch.QueueDelete(q, false, false, false)
				_ = ch.Close()
			}
		}
		for _, x := range []string{prefix + "events", topic, prefix + "dlq"} {
			if ch, err := conn.Channel(); err == nil {
				_ = ch.ExchangeDelete(x, false, false)
				_ = ch.Close()
			}
		}
		_ = conn.Close()
	})
	return r
}

// start runs the consumer's router with poison publisher pub on poisonTopic.
func (r *rig) start(pub message.Publisher, poisonTopic string) {
	r.t.Helper()
	sub, err := wamqp.NewSubscriber(r.cfg, watermill.NopLogger{})
	require.NoError(r.t, err)
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	require.NoError(r.t, err)
	poison, err := wmw.PoisonQueue(pub, poisonTopic)
	require.NoError(r.t, err)
	router.AddMiddleware(poison)
	router.AddConsumerHandler("stock", r.topic, sub, func(msg *message.Message) error {
		r.mu.Lock()
		r.calls[msg.UUID]++
		r.order = append(r.order, msg.UUID)
		r.mu.Unlock()
		if marshaler.EventName(msg) == "bad" {
			return errors.New("permanent: bad event") // PoisonQueue poisons every error
		}
		return nil
	})
	done := make(chan error, 1)
	go func() { done <- router.Run(context.Background()) }()
	r.router = router
	r.t.Cleanup(func() {
		_ = router.Close()
		<-done
		_ = sub.Close()
	})
	select {
	case <-router.Running():
	case err := <-done:
		r.t.Fatalf("router stopped: %v", err)
	case <-time.After(15 * time.Second):
		r.t.Fatal("router not running within 15 s")
	}
}

func (r *rig) publish(name string) string {
	r.t.Helper()
	pub, err := wamqp.NewPublisher(r.cfg, watermill.NopLogger{})
	require.NoError(r.t, err)
	defer pub.Close()
	id := uuid.Must(uuid.NewV7())
	msg, err := marshaler.NewMessageWithID(id, name, time.Now().UTC(), map[string]string{"k": "v"})
	require.NoError(r.t, err)
	require.NoError(r.t, pub.Publish(r.topic, msg))
	return msg.UUID
}

func (r *rig) callsOf(id string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.calls[id]
}

func (r *rig) ready(queue string) int {
	r.t.Helper()
	ch, err := r.conn.Channel()
	require.NoError(r.t, err)
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	require.NoError(r.t, err, "queue %s", queue)
	return q.Messages
}

func (r *rig) queueType(queue string) string {
	r.t.Helper()
	ch, err := r.conn.Channel()
	require.NoError(r.t, err)
	defer ch.Close()
	// A passive declaration with the wrong x-queue-type fails (406).
	_, err = ch.QueueDeclare(queue, true, false, false, false, amqp091.Table{"x-queue-type": "quorum"})
	if err == nil {
		return "quorum"
	}
	return "classic"
}

// The poison queue declared by DeclareDeadLetter, for the three
// watermill-amqp layouts, classic and quorum: a poisoned message lands in
// the dead-letter queue once, and never comes back to the consumer (a
// valid message published after it is handled, while the poisoned one was
// handled once: the queue is FIFO, so a copy routed back would have come
// first).
func TestDeclareDeadLetter(t *testing.T) {
	t.Parallel()
	for _, l := range layouts {
		for _, quorum := range []bool{false, true} {
			name := l.name + "/classic"
			if quorum {
				name = l.name + "/quorum"
			}
			// Odd cases use watermill-amqp's Publisher (PublisherConfig),
			// the others the confirmed PoisonPublisher (PoisonPublisherConfig).
			confirmed := quorum != (l.name == "topic")
			if confirmed {
				name += "/PoisonPublisher"
			} else {
				name += "/wamqp.Publisher"
			}
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				r := newRig(t, l, quorum)
				dl := idamqp.DeadLetterConfig{Subscriber: r.cfg, Topic: r.prefix + "dlq", Quorum: quorum}
				pubCfg, err := idamqp.DeclareDeadLetter(dl)
				require.NoError(t, err)
				poisonTopic := dl.PoisonTopic()
				var poison message.Publisher
				if confirmed {
					p, err := idamqp.NewConfirmedPublisher(pubCfg, watermill.NopLogger{})
					require.NoError(t, err)
					poison = p
				} else {
					p, err := wamqp.NewPublisher(dl.PublisherConfig(), watermill.NopLogger{})
					require.NoError(t, err)
					poison = p
				}
				t.Cleanup(func() { _ = poison.Close() })
				if l.name == "queue" {
					require.Empty(t, dl.ExchangeName(), "queue layout: the default exchange")
				} else {
					require.Equal(t, dl.Topic, dl.ExchangeName(), "exchange layouts: an exchange of its own")
				}
				r.start(poison, poisonTopic)

				bad := r.publish("bad")
				testenv.Eventually(t, 15*time.Second, "the bad message dead-lettered", func(o *testenv.Observed) bool {
					return o.Int("ready(dlq)", r.ready(dl.QueueName())) == 1
				})
				ok := r.publish("ok")
				testenv.Eventually(t, 15*time.Second, "the message after it handled", func(o *testenv.Observed) bool {
					return o.Int("calls(ok)", r.callsOf(ok)) == 1
				})
				require.Equal(t, 1, r.callsOf(bad), "the poisoned message never came back to the consumer")
				require.Equal(t, 1, r.ready(dl.QueueName()), "once in the dead-letter queue")
				require.Equal(t, 0, r.ready(r.queue), "the consumer's queue is empty")
				want := "classic"
				if quorum {
					want = "quorum"
				}
				require.Equal(t, want, r.queueType(dl.QueueName()))

				// The dead-lettered copy is the message, with the reason.
				ch, err := r.conn.Channel()
				require.NoError(t, err)
				defer ch.Close()
				d, got, err := ch.Get(dl.QueueName(), true)
				require.NoError(t, err)
				require.True(t, got)
				require.Equal(t, bad, d.MessageId)
				require.NotEmpty(t, d.Headers[wmw.ReasonForPoisonedKey])
				// Where `idem dlq redrive` sends it back: the consumer's
				// queue, which topic_poisoned names only in the queue layout.
				require.Equal(t, r.queue, d.Headers["idempotency_origin_queue"])
			})
		}
	}
}

// The trap DeclareDeadLetter avoids, shown on the broker: with
// NewDurableTopicConfig, SubscribeInitialize(poisonTopic) on the consumer's
// configuration binds the consumer's own queue to the poison routing key,
// so the poisoned message comes straight back.
func TestDeadLetter_naiveTopicLayoutLoops(t *testing.T) {
	t.Parallel()
	r := newRig(t, layouts[1], false)
	poisonTopic := r.queue + ".dlq"
	sub, err := wamqp.NewSubscriber(r.cfg, watermill.NopLogger{})
	require.NoError(t, err)
	require.NoError(t, sub.SubscribeInitialize(poisonTopic))
	require.NoError(t, sub.Close())
	pub, err := wamqp.NewPublisher(r.cfg, watermill.NopLogger{})
	require.NoError(t, err)
	poison := &closeAfterPublishes{Publisher: pub}
	t.Cleanup(func() { _ = poison.Close() })
	r.start(poison, poisonTopic)

	bad := r.publish("bad")
	testenv.Eventually(t, 15*time.Second, "the poisoned message back at the consumer", func(o *testenv.Observed) bool {
		return o.Int("calls(bad)", r.callsOf(bad)) >= 3
	})
	require.NoError(t, r.router.Close()) // stop the loop
}

// The poison publishers name the consumer's queue in
// idempotency_origin_queue, from topic_poisoned (here a routing key of the
// topic layout); a message without topic_poisoned gets none, and a value
// copied from its own metadata is dropped.
func TestDeadLetterConfigOriginQueue(t *testing.T) {
	t.Parallel()
	sub := wamqp.NewDurableTopicConfig(testenv.AMQPURL(), "events", "stock.events")
	sub.Marshaler = idamqp.Marshaler{}
	dl := idamqp.DeadLetterConfig{Subscriber: sub, Topic: "stock.events.dlq"}
	for name, m := range map[string]interface {
		Marshal(*message.Message) (amqp091.Publishing, error)
	}{"PoisonPublisherConfig": dl.PoisonPublisherConfig().Marshaler, "PublisherConfig": dl.PublisherConfig().Marshaler} {
		msg, err := marshaler.NewMessage("order.placed", map[string]int{"order": 1})
		require.NoError(t, err)
		msg.Metadata.Set("idempotency_origin_queue", "elsewhere")
		pub, err := m.Marshal(msg)
		require.NoError(t, err)
		require.NotContains(t, pub.Headers, "idempotency_origin_queue", name)
		msg.Metadata.Set(wmw.PoisonedTopicKey, "order.placed")
		pub, err = m.Marshal(msg)
		require.NoError(t, err)
		require.Equal(t, "stock.events", pub.Headers["idempotency_origin_queue"], name)
	}
}

func TestDeadLetterConfigValidate(t *testing.T) {
	t.Parallel()
	sub := wamqp.NewDurableQueueConfig(testenv.AMQPURL())
	constant := wamqp.NewDurableTopicConfig(testenv.AMQPURL(), "stock.events", "stock.q") // one queue, whatever the topic
	constant.Marshaler = idamqp.Marshaler{}
	for _, tc := range []struct {
		cfg  idamqp.DeadLetterConfig
		want string
	}{
		{idamqp.DeadLetterConfig{Topic: "x"}, "Subscriber.Connection.AmqpURI"},
		{idamqp.DeadLetterConfig{Subscriber: wamqp.Config{Connection: sub.Connection}, Topic: "x"}, "Subscriber.Marshaler"},
		{idamqp.DeadLetterConfig{Subscriber: sub}, "Topic"},
		{idamqp.DeadLetterConfig{Subscriber: sub, Topic: "amq.x"}, "Topic"},
		{idamqp.DeadLetterConfig{Subscriber: sub, Topic: "a b"}, "Topic"},
		{idamqp.DeadLetterConfig{Subscriber: sub, Topic: "x", Queue: "a/b"}, "Queue"},
		// The consumer's own queue (a constant name, whatever the topic)
		// as the dead-letter queue: every dead letter came back to the
		// consumer, failed again and was dead-lettered again, for ever
		// (2,167 times in 6 s for one message in a new user's app).
		{idamqp.DeadLetterConfig{Subscriber: constant, Topic: "stock.q"}, "Queue"},
		{idamqp.DeadLetterConfig{Subscriber: constant, Topic: "stock.dlq", Queue: "stock.q"}, "Queue"},
	} {
		err := tc.cfg.Validate()
		require.ErrorContains(t, err, "DeadLetterConfig."+tc.want)
		_, err = idamqp.DeclareDeadLetter(tc.cfg)
		require.ErrorContains(t, err, "DeadLetterConfig."+tc.want, "refused before anything is declared")
	}
	require.NoError(t, idamqp.DeadLetterConfig{Subscriber: sub, Topic: "stock.dlq"}.Validate())
	require.NoError(t, idamqp.DeadLetterConfig{Subscriber: constant, Topic: "stock.dlq"}.Validate())
	// The queue layout names each topic's queue after the topic: the
	// dead-letter queue is the poison topic's, which the consumer refuses to
	// subscribe to (middleware.Consumer.AddHandler).
	require.NoError(t, idamqp.DeadLetterConfig{Subscriber: sub, Topic: "stock.q"}.Validate())
}

// closeAfterPublishes closes its publisher only once no Publish runs and
// refuses Publish after that. The looping message is being poisoned while
// the router stops, and the router's Close does not wait for that
// handler's deferred poison publish; watermill-amqp v3.0.2's Close then
// writes ConnectionWrapper.connected while Publish reads it
// (ThreeDotsLabs/watermill#693, open), which -race reports.
type closeAfterPublishes struct {
	message.Publisher
	mu     sync.RWMutex
	closed bool
}

func (p *closeAfterPublishes) Publish(topic string, msgs ...*message.Message) error {
	p.mu.RLock()
	defer p.mu.RUnlock()
	if p.closed {
		return errors.New("publisher closed")
	}
	return p.Publisher.Publish(topic, msgs...)
}

func (p *closeAfterPublishes) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil
	}
	p.closed = true
	return p.Publisher.Close()
}
