package shop

import (
	"errors"
	"fmt"
	"regexp"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	amqp091 "github.com/rabbitmq/amqp091-go"

	idamqp "github.com/watermill-idempotency/idempotency/marshaler/amqp"
)

// Topology defaults.
const (
	// DefaultExchange is the topic exchange every event is published to.
	DefaultExchange = "events"
	// DefaultPrefetch is the consumer prefetch (unacked deliveries per subscription).
	DefaultPrefetch = 16
)

// Suffixes of the names derived from a consumer's name.
const (
	queueSuffix     = ".events"    // "stock" → "stock.events"
	dlxSuffix       = ".dlx"       // "stock.events" → "stock.events.dlx"
	dlqSuffix       = ".dlq"       // "stock.events" → "stock.events.dlq"
	reconcileSuffix = ".reconcile" // "billing.events" → "billing.events.reconcile"
)

// amqpName is what RabbitMQ accepts for exchange and queue names that we
// declare: letters, digits, hyphen, underscore, period, colon; at most 255
// bytes. "amq." names are reserved by the broker.
var amqpName = regexp.MustCompile(`^[A-Za-z0-9_.:-]{1,255}$`)

// Consumer is one consumer service's subscription.
type Consumer struct {
	// Name names the service ("stock"). It is the first half of the claim key
	// (consumer, event_id), so keep it stable; the queue is Name+".events".
	// Required; letters, digits, '-', '_', '.', ':'.
	Name string
	// Bindings are the routing keys bound to the queue: event names such as
	// "order.order.placed.v1", or AMQP topic patterns ("order.#"). At least one.
	Bindings []string
	// Reconcile gives the consumer a reconciliation queue, ReconcileQueue
	// ("billing.events.reconcile"), declared and deleted with its other
	// objects. A service of such a consumer (NewService) routes the messages
	// whose external operation ended uncertain, and that no reconcile
	// function could settle, there (operation.RouteUncertain) instead of
	// retrying or poisoning them: for consumers with external effects, such
	// as billing.
	Reconcile bool
}

// Topology names and shapes the broker objects of the shop. The zero value
// is the production topology (exchange "events", prefetch DefaultPrefetch).
type Topology struct {
	// Prefix is prepended to every exchange and queue name. "" in
	// production; tests and demo runs use a unique one (e.g. "t_3f2a9c01b2d4.")
	// so that they never share broker state.
	Prefix string

	// Exchange is the durable topic exchange events are published to, before
	// Prefix. Defaults to DefaultExchange.
	Exchange string

	// Prefetch is the QoS prefetch count of each subscription. Defaults to
	// DefaultPrefetch. watermill-amqp still hands deliveries to the router one
	// at a time per subscription; prefetch only keeps the network busy.
	Prefetch int

	// DeliveryLimit, when not 0, is sent as x-delivery-limit on every
	// consumer queue: after that many redeliveries RabbitMQ dead-letters a
	// message to the queue's dead-letter exchange. 0 leaves the broker
	// default (none on RabbitMQ 3.x, 20 on 4.x). Transient database failures
	// requeue with backoff and count as deliveries, so a limit bounds how long
	// a message survives an outage.
	DeliveryLimit int

	// Reconnect is the backoff between reconnection attempts after a broken
	// connection, of Subscriber and of the watermill-amqp publishers built
	// from these configurations (BackoffInitialInterval, BackoffMultiplier
	// and BackoffMaxInterval are used). Defaults to 100 ms initial, ×1.5, at
	// most 5 s.
	Reconnect *wamqp.ReconnectConfig
}

func (t Topology) withDefaults() Topology {
	if t.Exchange == "" {
		t.Exchange = DefaultExchange
	}
	if t.Prefetch == 0 {
		t.Prefetch = DefaultPrefetch
	}
	if t.Reconnect == nil {
		t.Reconnect = &wamqp.ReconnectConfig{
			BackoffInitialInterval:     100 * time.Millisecond,
			BackoffRandomizationFactor: 0.2,
			BackoffMultiplier:          1.5,
			BackoffMaxInterval:         5 * time.Second,
		}
	}
	return t
}

// Validate reports the first invalid field, naming it. consumers are checked
// too (Name and Bindings).
func (t Topology) Validate(consumers ...Consumer) error {
	t = t.withDefaults()
	if !amqpName.MatchString(t.ExchangeName()) {
		return fmt.Errorf("shop: Topology.Prefix/Exchange: exchange name %q must match %s", t.ExchangeName(), amqpName)
	}
	if t.Prefetch < 0 {
		return fmt.Errorf("shop: Topology.Prefetch %d: must be ≥ 0", t.Prefetch)
	}
	for _, c := range consumers {
		if c.Name == "" {
			return errors.New("shop: Consumer.Name is required")
		}
		for _, n := range []string{t.Queue(c), t.DeadLetterExchange(c), t.DeadLetterQueue(c), t.ReconcileQueue(c)} {
			if !amqpName.MatchString(n) {
				return fmt.Errorf("shop: Consumer.Name %q: derived name %q must match %s", c.Name, n, amqpName)
			}
		}
		if len(c.Bindings) == 0 {
			return fmt.Errorf("shop: Consumer %q: Bindings: at least one routing key required", c.Name)
		}
		for i, b := range c.Bindings {
			if b == "" || len(b) > 255 {
				return fmt.Errorf("shop: Consumer %q: Bindings[%d]: 1 to 255 bytes", c.Name, i)
			}
		}
	}
	return nil
}

// ExchangeName is the events exchange: Prefix + Exchange ("events").
func (t Topology) ExchangeName() string { return t.Prefix + t.withDefaults().Exchange }

// Queue is c's queue: Prefix + c.Name + ".events" ("stock.events").
func (t Topology) Queue(c Consumer) string { return t.Prefix + c.Name + queueSuffix }

// DeadLetterExchange is the fanout exchange of c's dead letters:
// Queue(c) + ".dlx" ("stock.events.dlx").
func (t Topology) DeadLetterExchange(c Consumer) string { return t.Queue(c) + dlxSuffix }

// DeadLetterQueue is the queue of c's dead letters: Queue(c) + ".dlq"
// ("stock.events.dlq").
func (t Topology) DeadLetterQueue(c Consumer) string { return t.Queue(c) + dlqSuffix }

// ReconcileQueue is the queue of c's uncertain operations, when c.Reconcile:
// Queue(c) + ".reconcile" ("billing.events.reconcile"). Messages reach it
// through the default exchange (routing key = the queue's name).
func (t Topology) ReconcileQueue(c Consumer) string { return t.Queue(c) + reconcileSuffix }

func (t Topology) queueArgs(c Consumer) amqp091.Table {
	args := amqp091.Table{
		"x-queue-type":           "quorum",
		"x-dead-letter-exchange": t.DeadLetterExchange(c),
	}
	if t.DeliveryLimit != 0 {
		args["x-delivery-limit"] = int64(t.DeliveryLimit)
	}
	return args
}

// Declare declares, idempotently, the events exchange and for each consumer
// its dead-letter exchange and queue, its reconciliation queue when
// Consumer.Reconcile, its quorum queue (dead-lettering to that exchange) and
// its bindings. Declaring an object that exists with other arguments fails
// with a channel error (406 PRECONDITION_FAILED), which closes ch.
func (t Topology) Declare(ch *amqp091.Channel, consumers ...Consumer) error {
	if err := t.Validate(consumers...); err != nil {
		return err
	}
	if err := ch.ExchangeDeclare(t.ExchangeName(), amqp091.ExchangeTopic, true, false, false, false, nil); err != nil {
		return fmt.Errorf("shop: declare exchange %s: %w", t.ExchangeName(), err)
	}
	for _, c := range consumers {
		if err := t.declareConsumer(ch, c); err != nil {
			return err
		}
	}
	return nil
}

// deadLetter is c's dead-letter topology for the library's helper: the
// fanout exchange DeadLetterExchange(c) (an exchange layout, as c's
// subscriber publishes through the events exchange) and the quorum queue
// DeadLetterQueue(c) bound to it.
func (t Topology) deadLetter(amqpURL string, c Consumer) idamqp.DeadLetterConfig {
	return idamqp.DeadLetterConfig{
		Subscriber: t.SubscriberConfig(amqpURL, c),
		Topic:      t.DeadLetterExchange(c),
		Queue:      t.DeadLetterQueue(c),
		Quorum:     true,
	}
}

func (t Topology) declareConsumer(ch *amqp091.Channel, c Consumer) error {
	q := t.Queue(c)
	if err := t.deadLetter("", c).Declare(ch); err != nil {
		return fmt.Errorf("shop: %w", err)
	}
	if c.Reconcile {
		rq := t.ReconcileQueue(c)
		if _, err := ch.QueueDeclare(rq, true, false, false, false, amqp091.Table{"x-queue-type": "quorum"}); err != nil {
			return fmt.Errorf("shop: declare reconciliation queue %s: %w", rq, err)
		}
	}
	if _, err := ch.QueueDeclare(q, true, false, false, false, t.queueArgs(c)); err != nil {
		return fmt.Errorf("shop: declare queue %s: %w", q, err)
	}
	for _, key := range c.Bindings {
		if err := ch.QueueBind(q, key, t.ExchangeName(), false, nil); err != nil {
			return fmt.Errorf("shop: bind %s to %s with %q: %w", q, t.ExchangeName(), key, err)
		}
	}
	return nil
}

// Delete removes each consumer's queue, dead-letter queue, reconciliation
// queue (when Consumer.Reconcile) and dead-letter exchange, then the events
// exchange, with their messages. For tests and demo runs that used a unique
// Prefix; never for a production topology. Objects that do not exist are not
// an error.
func (t Topology) Delete(ch *amqp091.Channel, consumers ...Consumer) error {
	var errs []error
	for _, c := range consumers {
		queues := []string{t.Queue(c), t.DeadLetterQueue(c)}
		if c.Reconcile {
			queues = append(queues, t.ReconcileQueue(c))
		}
		for _, q := range queues {
			if _, err := ch.QueueDelete(q, false, false, false); err != nil {
				errs = append(errs, fmt.Errorf("shop: delete queue %s: %w", q, err))
			}
		}
		if err := ch.ExchangeDelete(t.DeadLetterExchange(c), false, false); err != nil {
			errs = append(errs, fmt.Errorf("shop: delete exchange %s: %w", t.DeadLetterExchange(c), err))
		}
	}
	if err := ch.ExchangeDelete(t.ExchangeName(), false, false); err != nil {
		errs = append(errs, fmt.Errorf("shop: delete exchange %s: %w", t.ExchangeName(), err))
	}
	return errors.Join(errs...)
}

// PublisherConfig is the watermill-amqp configuration of a publisher of
// events: exchange ExchangeName() (topic, durable), routing key = the
// Watermill topic, which must be the event name; our JSON-envelope marshaler
// (persistent deliveries); publisher confirms (Publish returns after the
// broker has taken responsibility for the message); a pool of 4 channels.
func (t Topology) PublisherConfig(amqpURL string) wamqp.Config {
	t = t.withDefaults()
	cfg := t.baseConfig(amqpURL)
	cfg.Exchange = wamqp.ExchangeConfig{
		GenerateName: wamqp.GenerateExchangeNameConstant(t.ExchangeName()),
		Type:         amqp091.ExchangeTopic,
		Durable:      true,
	}
	cfg.Publish = wamqp.PublishConfig{
		GenerateRoutingKey: func(topic string) string { return topic },
		ConfirmDelivery:    true,
		ChannelPoolSize:    4,
	}
	return cfg
}

// PoisonPublisherConfig is the configuration of c's poison publisher
// (middleware.PoisonConfig.Publisher), from the library's
// idamqp.DeadLetterConfig: idamqp.NewConfirmedPublisher on c's dead-letter
// exchange (fanout, durable), so every poisoned message lands in c's
// dead-letter queue whatever the Watermill topic; confirmed and mandatory,
// so the poisoned delivery is acked only after the broker stored its copy in
// a queue. Malformed deliveries are published verbatim (see
// idamqp.Marshaler.Marshal).
func (t Topology) PoisonPublisherConfig(amqpURL string, c Consumer) idamqp.ConfirmedPublisherConfig {
	return t.deadLetter(amqpURL, c).PoisonPublisherConfig()
}

// ReconcilePublisherConfig is the watermill-amqp configuration of the
// publisher of uncertain operations (operation.RouteUncertain, with topic
// ReconcileQueue(c)): it publishes on the default exchange with the topic as
// routing key, so a message lands in the queue of that name; with publisher
// confirms, so the delivery is acked only after the broker holds the copy.
// The queue must exist, or the broker drops the message: Declare declares it
// for a consumer with Reconcile, and so does the consumer's Subscriber on
// every connection, before any delivery can be routed there.
func (t Topology) ReconcilePublisherConfig(amqpURL string) wamqp.Config {
	t = t.withDefaults()
	cfg := t.baseConfig(amqpURL)
	cfg.Exchange = wamqp.ExchangeConfig{GenerateName: wamqp.GenerateExchangeNameConstant("")} // the default exchange, never declared
	cfg.Publish = wamqp.PublishConfig{
		GenerateRoutingKey: func(topic string) string { return topic },
		ConfirmDelivery:    true,
		ChannelPoolSize:    1,
	}
	return cfg
}

// SubscriberConfig is the watermill-amqp configuration of c's subscriber,
// for services that prefer watermill-amqp's subscriber to Subscriber (see
// there why the examples do not use it: its reconnection is racy).
// Subscribe with any topic (Queue(c) reads best): the queue is always
// Queue(c). On every (re)subscription the topology builder declares c's
// whole topology (Declare), so a consumer can start before any producer. QoS
// prefetch is Topology.Prefetch. Nacked deliveries are requeued
// (watermill-amqp's behaviour, which the chain relies on for transient
// errors).
func (t Topology) SubscriberConfig(amqpURL string, c Consumer) wamqp.Config {
	t = t.withDefaults()
	cfg := t.baseConfig(amqpURL)
	cfg.Exchange = wamqp.ExchangeConfig{
		GenerateName: wamqp.GenerateExchangeNameConstant(t.ExchangeName()),
		Type:         amqp091.ExchangeTopic,
		Durable:      true,
	}
	cfg.Queue = wamqp.QueueConfig{
		GenerateName: wamqp.GenerateQueueNameConstant(t.Queue(c)),
		Durable:      true,
		Arguments:    t.queueArgs(c),
	}
	cfg.QueueBind = wamqp.QueueBindConfig{GenerateRoutingKey: func(string) string { return "" }}
	cfg.Consume = wamqp.ConsumeConfig{Qos: wamqp.QosConfig{PrefetchCount: t.Prefetch}}
	cfg.TopologyBuilder = &topologyBuilder{t: t, c: c}
	return cfg
}

func (t Topology) baseConfig(amqpURL string) wamqp.Config {
	return wamqp.Config{
		Connection: wamqp.ConnectionConfig{AmqpURI: amqpURL, Reconnect: t.Reconnect},
		Marshaler:  idamqp.Marshaler{},
		// Publisher-side declarations go through ExchangeDeclare below, so
		// they use the same kind and durability as Declare.
		TopologyBuilder: &topologyBuilder{t: t},
	}
}

// topologyBuilder makes watermill-amqp declare our topology instead of its
// default one (which declares neither dead-letter exchange nor queue).
type topologyBuilder struct {
	t Topology
	c Consumer // zero for publishers
}

var _ wamqp.TopologyBuilder = (*topologyBuilder)(nil)

func (b *topologyBuilder) ExchangeDeclare(ch *amqp091.Channel, name string, cfg wamqp.Config) error {
	return ch.ExchangeDeclare(name, cfg.Exchange.Type, cfg.Exchange.Durable, false, false, false, nil)
}

func (b *topologyBuilder) BuildTopology(ch *amqp091.Channel, _ wamqp.BuildTopologyParams, _ wamqp.Config, _ watermill.LoggerAdapter) error {
	if b.c.Name == "" {
		return errors.New("shop: BuildTopology on a publisher configuration")
	}
	return b.t.Declare(ch, b.c)
}
