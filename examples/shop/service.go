package shop

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	idamqp "github.com/watermill-idempotency/idempotency/marshaler/amqp"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/operation"
	"github.com/watermill-idempotency/idempotency/outbox"
)

// DefaultCloseTimeout bounds how long Service.Close waits for running handlers.
const DefaultCloseTimeout = 10 * time.Second

// ServiceConfig wires one consumer service: see NewService.
type ServiceConfig struct {
	// AMQPURL is the broker of the publishers (poison, events, reconciliation)
	// and, unless SubscriberURL is set, of the subscriber. Required unless
	// Transport is set.
	AMQPURL string
	// SubscriberURL, when not "", is the subscriber's broker URL instead of
	// AMQPURL: the demo and the tests route it through a fault proxy so they
	// can cut the consumer's connection alone.
	SubscriberURL string
	// Topology names the broker objects. Its zero value is production's.
	Topology Topology
	// Transport, when set, is the broker instead of RabbitMQ at AMQPURL
	// (AMQPURL, SubscriberURL and Topology are then unused): a
	// *ChannelBroker runs the service in one process with nothing installed.
	Transport Transport
	// Consumer is the service's subscription. Required. With
	// Consumer.Reconcile, uncertain external operations are routed to
	// Topology.ReconcileQueue(Consumer) (see Idempotency).
	Consumer Consumer
	// Pool is the service's database (idempotency.Pgx(Pool)). The consumer
	// (middleware.NewConsumer) claims each event on it and gives the handler
	// the attempt's transaction (middleware.PgxTxFromContext, or
	// TxFromContext); the outbox relay reads it. Its processed-event table
	// must exist (processed.Migrate) before NewService. Exactly one of Pool
	// and DB is required.
	Pool *pgxpool.Pool
	// DB, instead of Pool, is the service's database on SQLite (database/sql
	// with modernc.org/sqlite, see SQLiteDB; idempotency.SQL(DB,
	// idempotency.SQLite)): the handler finds the attempt's transaction with
	// middleware.SQLTxFromContext or TxFromContext. The Outbox must then be
	// on the same database (DB.Outbox).
	DB *sql.DB
	// Handler is the service's handler. It runs inside the attempt's
	// transaction, at most once per event_id with a committed effect.
	// Exactly one of Handler and PublishHandler is required.
	Handler message.NoPublishHandlerFunc
	// PublishHandler, instead of Handler, is a handler that produces
	// messages (billing's HandleOrderPlaced): those it returns are sent to
	// PublishTopic on the events exchange. With Outbox (recommended) they are
	// written to the outbox in the attempt's transaction and exist only if it
	// commits; without, the router publishes them after the commit, and a
	// crash or a failed publish in between loses them.
	PublishHandler message.HandlerFunc
	// PublishTopic is the event name of the messages PublishHandler returns:
	// their routing key on the events exchange. Required with PublishHandler.
	PublishTopic string
	// Outbox, when set, is the service's transactional outbox, in Pool's
	// database: NewService sets Idempotency.Outbox to it, so the messages the
	// handler returns (or publishes through middleware.PublisherFromContext)
	// are written in the attempt's transaction, and the service runs a relay
	// (Outbox.NewRelay) that publishes them to the events exchange after the
	// commit, at least once, each with the event id it was written with. Its
	// tables must exist before Run (Outbox.Migrate, or its migrations).
	// Setting Idempotency.Outbox is an error: set this field.
	Outbox *outbox.Outbox
	// Relay tunes the relay of Outbox (poll interval, batch size, retention, …).
	Relay outbox.RelayConfig
	// RelayDest, when set, wraps the relay's destination publisher (the
	// events publisher): fault injection, metrics. Optional.
	RelayDest func(message.Publisher) message.Publisher
	// Workers is how many subscriptions consume the queue, each handling
	// one delivery at a time, all through the service's one router handler
	// (named Consumer.Name) and its one middleware.Consumer: they share the
	// claim key's consumer name Consumer.Name. Defaults to 1.
	Workers int
	// Middleware is added to the router before the consumer's chain, so it
	// runs outside it (outermost first): metrics, tracing, fault injection.
	Middleware []message.HandlerMiddleware
	// Idempotency configures the service's middleware.Consumer (the whole
	// chain: poison → retry and hold → recoverer → claim): Table, Layout,
	// ReplayHorizon, Retry, AfterPoison, Recorder, LockTimeout, … are
	// passed through. NewService sets DB (Pool or DB), Poison (the
	// consumer's dead-letter exchange) and Outbox (the Outbox field), and
	// Consumer to Consumer.Name when empty. With Consumer.Reconcile it puts
	// operation.RouteUncertain (to the consumer's reconciliation queue)
	// first in AfterPoison, before the caller's.
	Idempotency middleware.ConsumerConfig
	// CloseTimeout bounds Close's wait for running handlers. Defaults to
	// DefaultCloseTimeout.
	CloseTimeout time.Duration
	// Logger is used by the router, the subscriber, the publishers, the relay
	// and the middleware. Defaults to watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

// Validate reports the first invalid field, naming it.
func (c ServiceConfig) Validate() error {
	switch {
	case c.AMQPURL == "" && c.Transport == nil:
		return errors.New("shop: ServiceConfig.AMQPURL is required")
	case c.Pool == nil && c.DB == nil:
		return errors.New("shop: ServiceConfig.Pool is required (or DB)")
	case c.Pool != nil && c.DB != nil:
		return errors.New("shop: ServiceConfig.Pool and DB: set one, not both")
	case c.Handler == nil && c.PublishHandler == nil:
		return errors.New("shop: ServiceConfig.Handler or PublishHandler is required")
	case c.Handler != nil && c.PublishHandler != nil:
		return errors.New("shop: ServiceConfig.Handler and PublishHandler: set one, not both")
	case c.PublishHandler != nil && c.PublishTopic == "":
		return errors.New("shop: ServiceConfig.PublishTopic is required with PublishHandler")
	case c.PublishHandler == nil && c.PublishTopic != "":
		return errors.New("shop: ServiceConfig.PublishTopic is only for PublishHandler")
	case c.Idempotency.Outbox != nil && c.Idempotency.Outbox != c.Outbox:
		return errors.New("shop: ServiceConfig.Idempotency.Outbox: set ServiceConfig.Outbox instead (the service runs its relay)")
	case c.Idempotency.Poison.Publisher != nil || c.Idempotency.Poison.Topic != "":
		return errors.New("shop: ServiceConfig.Idempotency.Poison: set by NewService (the consumer's dead-letter exchange)")
	case c.Workers < 0:
		return fmt.Errorf("shop: ServiceConfig.Workers %d: must be ≥ 0", c.Workers)
	}
	return c.Topology.Validate(c.Consumer)
}

// Service is one running consumer service: a Watermill router whose handler
// consumes the service's queue through the consumer's whole chain
// (middleware.NewConsumer: poison → [RouteUncertain →] retry and hold →
// recoverer → claim) around the handler, and, with an outbox, the relay of
// its produced messages.
type Service struct {
	// Router is the service's router, exposed for plugins; Run and Close
	// drive it.
	Router *message.Router

	subscriber message.Subscriber
	poison     message.Publisher
	events     message.Publisher // router's publisher and relay's destination; nil without either
	reconcile  message.Publisher // nil without Consumer.Reconcile
	relay      *outbox.Relay
	running    chan struct{}
	closeOnce  sync.Once
	closeErr   error
}

// NewService validates cfg (on a copy) and builds the service: a
// Subscriber on Topology.Queue(Consumer) (declaring the consumer's whole
// topology when it subscribes), a poison publisher on the consumer's
// dead-letter exchange, a reconciliation publisher with Consumer.Reconcile,
// an events publisher for PublishHandler and the outbox relay, the
// middleware.Consumer (which reads its processed-event table's replay
// horizon: migrate it first) and the router's one handler. It connects to
// the broker and the database; it does not start consuming or relaying
// (Run).
func NewService(cfg ServiceConfig) (*Service, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Workers == 0 {
		cfg.Workers = 1
	}
	if cfg.CloseTimeout == 0 {
		cfg.CloseTimeout = DefaultCloseTimeout
	}
	if cfg.SubscriberURL == "" {
		cfg.SubscriberURL = cfg.AMQPURL
	}
	if cfg.Logger == nil {
		cfg.Logger = watermill.NopLogger{}
	}
	if cfg.Transport == nil {
		cfg.Transport = AMQPTransport{URL: cfg.AMQPURL, SubscriberURL: cfg.SubscriberURL, Topology: cfg.Topology}
	}
	s := &Service{running: make(chan struct{})}
	if err := s.build(cfg); err != nil {
		s.closeAll()
		return nil, err
	}
	return s, nil
}

func (s *Service) build(cfg ServiceConfig) error {
	var err error
	cc := cfg.Idempotency
	cc.DB = cfg.db().Handle()
	if cc.Consumer == "" {
		cc.Consumer = cfg.Consumer.Name
	}
	cc.Outbox = cfg.Outbox
	if s.poison, cc.Poison.Topic, err = cfg.Transport.PoisonPublisher(cfg.Consumer, cfg.Logger); err != nil {
		return fmt.Errorf("shop: poison publisher: %w", err)
	}
	cc.Poison.Publisher = s.poison
	if cfg.Consumer.Reconcile {
		var reconcileTopic string
		if s.reconcile, reconcileTopic, err = cfg.Transport.ReconcilePublisher(cfg.Consumer, cfg.Logger); err != nil {
			return fmt.Errorf("shop: reconciliation publisher: %w", err)
		}
		route, err := operation.RouteUncertain(s.reconcile, reconcileTopic, cfg.Logger)
		if err != nil {
			return err
		}
		cc.AfterPoison = append([]message.HandlerMiddleware{route}, cfg.Idempotency.AfterPoison...)
	}
	// The whole chain, attached to the service's one handler (never
	// router-wide: a router that also consumed the poison topic would wrap
	// its handler too).
	consumer, err := middleware.NewConsumer(cc, cfg.Logger)
	if err != nil {
		return fmt.Errorf("shop: consumer %s: %w", cc.Consumer, err)
	}
	if cfg.PublishHandler != nil || cfg.Outbox != nil {
		if s.events, err = cfg.Transport.EventsPublisher(cfg.Logger); err != nil {
			return fmt.Errorf("shop: events publisher: %w", err)
		}
	}
	if cfg.Outbox != nil {
		dest := s.events
		if cfg.RelayDest != nil {
			dest = cfg.RelayDest(dest)
		}
		if s.relay, err = cfg.Outbox.NewRelay(dest, cfg.Relay); err != nil {
			return fmt.Errorf("shop: relay: %w", err)
		}
	}
	if s.subscriber, err = cfg.Transport.Subscriber(cfg.Consumer, cfg.Logger); err != nil {
		return fmt.Errorf("shop: subscriber: %w", err)
	}
	if s.Router, err = message.NewRouter(message.RouterConfig{CloseTimeout: cfg.CloseTimeout}, cfg.Logger); err != nil {
		return err
	}
	s.Router.AddMiddleware(cfg.Middleware...)
	queue := cfg.Topology.Queue(cfg.Consumer)
	sub := Subscriptions(s.subscriber, cfg.Workers)
	if cfg.PublishHandler != nil {
		_, err = consumer.AddHandler(s.Router, cfg.Consumer.Name, queue, sub, cfg.PublishTopic, s.events, cfg.PublishHandler)
	} else {
		_, err = consumer.AddConsumerHandler(s.Router, cfg.Consumer.Name, queue, sub, cfg.Handler)
	}
	return err
}

// Run consumes, and relays the outbox, until ctx is done or Close is
// called, then returns (after the router has stopped its handlers and the
// relay has stopped). A relay that stops with an error stops the service.
// It returns the router's and the relay's errors, if any. Call it once.
func (s *Service) Run(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	relayDone := make(chan error, 1)
	relayRunning := make(chan struct{})
	if s.relay == nil {
		relayDone <- nil
		close(relayRunning)
	} else {
		relayRunning = s.relay.Running()
		go func() {
			err := s.relay.Run(ctx)
			cancel()
			relayDone <- err
		}()
	}
	go func() {
		for _, c := range []<-chan struct{}{s.Router.Running(), relayRunning} {
			select {
			case <-c:
			case <-ctx.Done():
				return
			}
		}
		close(s.running)
	}()
	err := s.Router.Run(ctx)
	if cerr := s.Router.Close(); err == nil {
		err = cerr
	}
	cancel()
	if rerr := <-relayDone; rerr != nil {
		err = errors.Join(err, fmt.Errorf("shop: relay: %w", rerr))
	}
	return err
}

// Running is closed once every handler is subscribed and the relay, if
// any, reads the outbox.
func (s *Service) Running() chan struct{} { return s.running }

// Close stops the router (waiting up to CloseTimeout for running handlers),
// the subscriber, the relay and the publishers. A delivery in flight is
// finished and acked first (see Subscriber.Close); prefetched deliveries not
// yet handed out are requeued by the broker. Outbox rows not yet relayed
// stay in the outbox for the next run. Safe to call twice.
func (s *Service) Close() error {
	s.closeOnce.Do(func() { s.closeErr = s.closeAll() })
	return s.closeErr
}

// closeAll closes what was built, in dependency order.
func (s *Service) closeAll() error {
	var errs []error
	if s.Router != nil {
		errs = append(errs, s.Router.Close())
	}
	if s.subscriber != nil {
		errs = append(errs, s.subscriber.Close())
	}
	if s.relay != nil {
		errs = append(errs, s.relay.Close())
	}
	for _, p := range []message.Publisher{s.events, s.reconcile, s.poison} {
		if p != nil {
			errs = append(errs, p.Close())
		}
	}
	return errors.Join(errs...)
}

func (c ServiceConfig) db() DB {
	if c.DB != nil {
		return SQLiteDB(c.DB)
	}
	return PgxDB(c.Pool)
}

// Transport is the broker side of a service: its queue's subscriber and its
// publishers. AMQPTransport is RabbitMQ (the default); *ChannelBroker is the
// in-process stand-in of the embedded demo.
type Transport interface {
	// Subscriber consumes c's queue (the topic passed to Subscribe is
	// ignored).
	Subscriber(c Consumer, logger watermill.LoggerAdapter) (message.Subscriber, error)
	// EventsPublisher publishes events, the Watermill topic being the event
	// name.
	EventsPublisher(logger watermill.LoggerAdapter) (message.Publisher, error)
	// PoisonPublisher publishes, on topic, to c's dead letters.
	PoisonPublisher(c Consumer, logger watermill.LoggerAdapter) (pub message.Publisher, topic string, err error)
	// ReconcilePublisher publishes, on topic, to c's reconciliation queue.
	ReconcilePublisher(c Consumer, logger watermill.LoggerAdapter) (pub message.Publisher, topic string, err error)
}

// AMQPTransport is RabbitMQ with the shop's topology: watermill-amqp
// publishers and this package's Subscriber.
type AMQPTransport struct {
	// URL is the broker of the publishers and, unless SubscriberURL is set,
	// of the subscriber.
	URL string
	// SubscriberURL, when not "", is the subscriber's URL (a fault proxy).
	SubscriberURL string
	// Topology names the broker objects.
	Topology Topology
}

var _ Transport = AMQPTransport{}

// Subscriber implements Transport: a subscriber on c's queue.
func (t AMQPTransport) Subscriber(c Consumer, logger watermill.LoggerAdapter) (message.Subscriber, error) {
	url := t.SubscriberURL
	if url == "" {
		url = t.URL
	}
	sub, err := t.Topology.NewSubscriber(url, c, logger)
	if err != nil {
		return nil, err // not a typed nil
	}
	return sub, nil
}

// EventsPublisher implements Transport: a publisher to the events exchange.
func (t AMQPTransport) EventsPublisher(logger watermill.LoggerAdapter) (message.Publisher, error) {
	p, err := wamqp.NewPublisher(t.Topology.PublisherConfig(t.URL), logger)
	if err != nil {
		return nil, err // not a typed nil
	}
	return p, nil
}

// PoisonPublisher implements Transport: a publisher to c's dead-letter
// exchange (fanout, bound to c's dead-letter queue by Topology.Declare), and
// the poison topic to give it. It is the library's confirmed publisher
// (idamqp.NewConfirmedPublisher: confirms + mandatory), so a poisoned delivery
// is acked only once its copy is stored in a queue.
func (t AMQPTransport) PoisonPublisher(c Consumer, logger watermill.LoggerAdapter) (message.Publisher, string, error) {
	p, err := idamqp.NewConfirmedPublisher(t.Topology.PoisonPublisherConfig(t.URL, c), logger)
	if err != nil {
		return nil, "", err
	}
	return p, t.Topology.DeadLetterQueue(c), nil
}

// ReconcilePublisher implements Transport: a publisher to c's
// reconciliation queue, and the topic to give it.
func (t AMQPTransport) ReconcilePublisher(c Consumer, logger watermill.LoggerAdapter) (message.Publisher, string, error) {
	p, err := wamqp.NewPublisher(t.Topology.ReconcilePublisherConfig(t.URL), logger)
	if err != nil {
		return nil, "", err
	}
	return p, t.Topology.ReconcileQueue(c), nil
}
