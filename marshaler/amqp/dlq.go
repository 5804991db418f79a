package amqp

import (
	"errors"
	"fmt"
	"maps"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
)

// QueueTypeQuorum is the x-queue-type of a quorum queue.
const QueueTypeQuorum = "quorum"

// headerOriginQueue is the header the poison publishers of a
// DeadLetterConfig (PoisonPublisherConfig, PublisherConfig) set on each
// poisoned message: the queue its consumer read it from,
// Subscriber.Queue.GenerateName of its topic_poisoned; `idem dlq redrive`
// sends the message back there. topic_poisoned alone names that queue only
// in the queue layout: with amqp.NewDurableTopicConfig it is a routing key,
// with amqp.NewDurablePubSubConfig an exchange.
const headerOriginQueue = "idempotency_origin_queue"

// poisonedTopicKey is Watermill's PoisonedTopicKey ("topic_poisoned",
// message/router/middleware), which the chain sets too.
const poisonedTopicKey = "topic_poisoned"

// DeadLetterConfig configures DeclareDeadLetter: where poisoned messages
// (middleware.PoisonConfig.Publisher / Topic) of a
// watermill-amqp consumer go.
//
// The obvious way, SubscribeInitialize(poisonTopic) on the consumer's own
// configuration, is wrong for a consumer built with
// amqp.NewDurableTopicConfig (one constant queue name): it binds the
// consumer's OWN queue to the poison routing key, so every poisoned message
// comes straight back to the consumer (hundreds of rejections a second).
// Without any declared dead-letter queue, a poisoned message published to
// an exchange or queue that routes nowhere is dropped by the broker, with no
// error. DeclareDeadLetter declares a dedicated queue and returns the
// publisher configuration that routes there.
type DeadLetterConfig struct {
	// Subscriber is the consumer's watermill-amqp configuration, as its
	// Subscriber was built (amqp.NewDurableQueueConfig,
	// amqp.NewDurableTopicConfig, amqp.NewDurablePubSubConfig or a custom
	// one). Its Connection (URI, TLS, reconnect) and Marshaler are reused
	// for the poison publisher (use this package's Marshaler, so that
	// malformed deliveries are dead-lettered verbatim); its layout decides
	// how the dead-letter queue is reached:
	//
	//   - queue layout (Exchange.GenerateName(Topic) is "", the default
	//     exchange, as amqp.NewDurableQueueConfig): a queue named Queue,
	//     reached through the default exchange with routing key Queue;
	//   - exchange layouts (a topic exchange as amqp.NewDurableTopicConfig,
	//     an exchange per topic as amqp.NewDurablePubSubConfig): a fanout
	//     exchange named Topic, of its own (never the consumer's events
	//     exchange, where "#" bindings would receive the poisoned copies
	//     too), and the queue bound to it.
	//
	// Connection.AmqpURI is required.
	Subscriber wamqp.Config
	// Topic is the poison topic: pass the same value as
	// middleware.PoisonConfig.Topic. Required; letters, digits, '-',
	// '_', '.', ':' (at most 255 bytes, not starting with "amq.").
	Topic string
	// Queue names the dead-letter queue. Defaults to Topic.
	Queue string
	// Quorum declares the queue as a quorum queue (x-queue-type quorum,
	// replicated; always durable). When false the queue is a durable
	// classic queue.
	Quorum bool
	// Arguments are extra queue arguments (x-max-length, x-message-ttl,
	// …), merged under x-queue-type. Declaring a queue that exists with
	// other arguments fails (406 PRECONDITION_FAILED).
	Arguments amqp091.Table
}

// Validate reports the first invalid field, naming it.
func (c DeadLetterConfig) Validate() error {
	switch {
	case c.Subscriber.Connection.AmqpURI == "":
		return errors.New("amqp: DeadLetterConfig.Subscriber.Connection.AmqpURI is required")
	case c.Subscriber.Marshaler == nil:
		return errors.New("amqp: DeadLetterConfig.Subscriber.Marshaler is required")
	}
	return c.validateNames()
}

// validateNames checks what Declare needs (it is given a channel: no URI).
func (c DeadLetterConfig) validateNames() error {
	switch {
	case !validName(c.Topic):
		return fmt.Errorf("amqp: DeadLetterConfig.Topic %q: 1 to 255 of [A-Za-z0-9_.:-], not amq.*", c.Topic)
	case c.Queue != "" && !validName(c.Queue):
		return fmt.Errorf("amqp: DeadLetterConfig.Queue %q: 1 to 255 of [A-Za-z0-9_.:-], not amq.*", c.Queue)
	case c.consumersOwnQueue():
		// The dead letters would be delivered to the consumer again, fail
		// again and be dead-lettered again, for ever.
		return fmt.Errorf("amqp: DeadLetterConfig.Queue %q (Queue, else Topic) is the consumer's own queue "+
			"(Subscriber.Queue.GenerateName names every topic's queue %q): give the dead-letter queue a name of its own",
			c.withDefaults().Queue, c.withDefaults().Queue)
	}
	return nil
}

// consumersOwnQueue reports whether Subscriber names its queue with a
// constant (amqp.GenerateQueueNameConstant: the same queue whatever the
// topic) that is the dead-letter queue. Two probe topics that share no
// segment with each other or with Topic tell: a generator that maps topics
// to a queue per family (a prefix of the topic) names them apart.
func (c DeadLetterConfig) consumersOwnQueue() bool {
	gen := c.Subscriber.Queue.GenerateName
	if gen == nil {
		return false
	}
	q := c.withDefaults().Queue
	return probeQueueName(gen, "idempotency-probe-a.x1") == q && probeQueueName(gen, "idempotency-probe-b.y2") == q
}

// probeQueueName is gen(topic), or "" when gen panics on a topic it does
// not expect.
func probeQueueName(gen wamqp.QueueNameGenerator, topic string) (name string) {
	defer func() {
		if recover() != nil {
			name = ""
		}
	}()
	return gen(topic)
}

func validName(s string) bool {
	if len(s) == 0 || len(s) > 255 || (len(s) >= 4 && s[:4] == "amq.") {
		return false
	}
	for _, r := range s {
		ok := r == '-' || r == '_' || r == '.' || r == ':' || ('0' <= r && r <= '9') || ('a' <= r && r <= 'z') || ('A' <= r && r <= 'Z')
		if !ok {
			return false
		}
	}
	return true
}

func (c DeadLetterConfig) withDefaults() DeadLetterConfig {
	if c.Queue == "" {
		c.Queue = c.Topic
	}
	return c
}

// queueLayout reports whether the subscriber publishes on the default
// exchange (queue named after the topic).
func (c DeadLetterConfig) queueLayout() bool {
	return c.Subscriber.Exchange.GenerateName == nil || c.Subscriber.Exchange.GenerateName(c.Topic) == ""
}

// QueueName is the dead-letter queue's name: Queue, else Topic.
func (c DeadLetterConfig) QueueName() string { return c.withDefaults().Queue }

// ExchangeName is the dead-letter exchange's name: "" (the default
// exchange) for the queue layout, else Topic.
func (c DeadLetterConfig) ExchangeName() string {
	if c.queueLayout() {
		return ""
	}
	return c.Topic
}

func (c DeadLetterConfig) queueArgs() amqp091.Table {
	args := amqp091.Table{}
	maps.Copy(args, c.Arguments)
	if c.Quorum {
		args["x-queue-type"] = QueueTypeQuorum
	}
	return args
}

// Declare declares on ch, idempotently, the dead-letter queue (durable;
// quorum when Quorum) and, for an exchange layout, the fanout exchange
// Topic (durable) with the queue bound to it. A declaration that conflicts
// with an existing object fails with the broker's channel error, which
// closes ch. Subscriber's connection and marshaler are not needed here.
func (c DeadLetterConfig) Declare(ch *amqp091.Channel) error {
	if err := c.validateNames(); err != nil {
		return err
	}
	c = c.withDefaults()
	if _, err := ch.QueueDeclare(c.Queue, true, false, false, false, c.queueArgs()); err != nil {
		return fmt.Errorf("amqp: declare dead-letter queue %s: %w", c.Queue, err)
	}
	if c.queueLayout() {
		return nil
	}
	if err := ch.ExchangeDeclare(c.Topic, amqp091.ExchangeFanout, true, false, false, false, nil); err != nil {
		return fmt.Errorf("amqp: declare dead-letter exchange %s: %w", c.Topic, err)
	}
	if err := ch.QueueBind(c.Queue, "", c.Topic, false, nil); err != nil {
		return fmt.Errorf("amqp: bind dead-letter queue %s to %s: %w", c.Queue, c.Topic, err)
	}
	return nil
}

// PoisonTopic is the topic to give middleware.PoisonConfig.Topic with
// the publisher of ConfirmedPublisherConfig or PublisherConfig: QueueName() in
// the queue layout (the routing key on the default exchange), Topic in the
// exchange layouts (a fanout exchange routes any key to the queue).
func (c DeadLetterConfig) PoisonTopic() string {
	if c.queueLayout() {
		return c.QueueName()
	}
	return c.Topic
}

// ConfirmedPublisherConfig is the configuration of this package's confirmed,
// mandatory ConfirmedPublisher (NewConfirmedPublisher) for the dead-letter
// topology: Subscriber's URL and marshaler (adding the header
// idempotency_origin_queue: the queue the message was consumed from), the
// exchange ExchangeName(). Give the chain PoisonTopic() as its topic. Unlike
// watermill-amqp's Publisher, it reports a message the broker could not
// route (ErrUnroutable).
func (c DeadLetterConfig) PoisonPublisherConfig() ConfirmedPublisherConfig {
	return ConfirmedPublisherConfig{
		URL:       c.Subscriber.Connection.AmqpURI,
		Exchange:  c.ExchangeName(),
		Marshaler: c.originMarshaler(),
	}
}

// originMarshaler is Subscriber.Marshaler adding headerOriginQueue, or
// Subscriber.Marshaler itself when there is no queue name to derive.
func (c DeadLetterConfig) originMarshaler() wamqp.Marshaler {
	if c.Subscriber.Marshaler == nil || c.Subscriber.Queue.GenerateName == nil {
		return c.Subscriber.Marshaler
	}
	return originMarshaler{Marshaler: c.Subscriber.Marshaler, queue: c.Subscriber.Queue.GenerateName}
}

// originMarshaler sets headerOriginQueue on its Marshaler's publishings:
// queue(topic_poisoned), or no such header when the message has no
// topic_poisoned (one copied from the message's own metadata is dropped).
type originMarshaler struct {
	wamqp.Marshaler
	queue wamqp.QueueNameGenerator
}

func (m originMarshaler) Marshal(msg *message.Message) (amqp091.Publishing, error) {
	pub, err := m.Marshaler.Marshal(msg)
	if err != nil {
		return pub, err
	}
	delete(pub.Headers, headerOriginQueue)
	topic := msg.Metadata.Get(poisonedTopicKey)
	if topic == "" {
		return pub, nil
	}
	if q := m.queue(topic); q != "" {
		if pub.Headers == nil {
			pub.Headers = amqp091.Table{}
		}
		pub.Headers[headerOriginQueue] = q
	}
	return pub, nil
}

// PublisherConfig is the watermill-amqp configuration of a poison
// publisher, for users of watermill-amqp's Publisher (ConfirmedPublisherConfig
// is the safer choice: watermill-amqp never reads basic.return): Subscriber's connection and marshaler; the default exchange
// with routing key QueueName() (queue layout), or the fanout exchange Topic
// (exchange layouts), whatever topic the message is published to; the
// marshaler Subscriber's, adding idempotency_origin_queue; with
// publisher confirms (Publish returns after the broker holds the copy, so
// the poisoned delivery is acked only then). It declares no queue: call
// Declare (or DeclareDeadLetter) first, or the broker drops the messages.
func (c DeadLetterConfig) PublisherConfig() wamqp.Config {
	c = c.withDefaults()
	exchange, routingKey := c.ExchangeName(), c.Queue
	exchangeType := ""
	if exchange != "" {
		exchangeType, routingKey = amqp091.ExchangeFanout, ""
	}
	return wamqp.Config{
		Connection: c.Subscriber.Connection,
		Marshaler:  c.originMarshaler(),
		Exchange: wamqp.ExchangeConfig{
			GenerateName: wamqp.GenerateExchangeNameConstant(exchange),
			Type:         exchangeType,
			Durable:      true,
		},
		Publish: wamqp.PublishConfig{
			GenerateRoutingKey: func(string) string { return routingKey },
			ConfirmDelivery:    true,
		},
		// Declares exchanges only (the publisher's one, as Declare did):
		// a custom builder of the subscriber's is not reused.
		TopologyBuilder: &wamqp.DefaultTopologyBuilder{},
	}
}

// DeclareDeadLetter connects with cfg.Subscriber.Connection (URI and TLS),
// declares the dead-letter topology (DeadLetterConfig.Declare) and returns
// the poison publisher's configuration (DeadLetterConfig.PoisonPublisherConfig):
//
//	dl := idamqp.DeadLetterConfig{Subscriber: sub, Topic: "stock.events.dlq", Quorum: true}
//	pubCfg, err := idamqp.DeclareDeadLetter(dl)
//	poison, err := idamqp.NewConfirmedPublisher(pubCfg, logger)
//	// middleware.ConsumerConfig{Poison: middleware.PoisonConfig{Publisher: poison, Topic: dl.PoisonTopic()}, …}
func DeclareDeadLetter(cfg DeadLetterConfig) (ConfirmedPublisherConfig, error) {
	if err := cfg.Validate(); err != nil {
		return ConfirmedPublisherConfig{}, err
	}
	conn, err := amqp091.DialConfig(cfg.Subscriber.Connection.AmqpURI, amqp091.Config{
		TLSClientConfig: cfg.Subscriber.Connection.TLSConfig,
		Properties:      amqp091.Table{"connection_name": "idempotency dead-letter declaration"},
	})
	if err != nil {
		return ConfirmedPublisherConfig{}, fmt.Errorf("amqp: dead-letter declaration: connect: %w", err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return ConfirmedPublisherConfig{}, fmt.Errorf("amqp: dead-letter declaration: channel: %w", err)
	}
	defer ch.Close()
	if err := cfg.Declare(ch); err != nil {
		return ConfirmedPublisherConfig{}, err
	}
	return cfg.PoisonPublisherConfig(), nil
}
