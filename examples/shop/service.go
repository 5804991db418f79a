package shop

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency/middleware"
)

// DefaultCloseTimeout bounds how long Service.Close waits for running handlers.
const DefaultCloseTimeout = 10 * time.Second

// ServiceConfig wires one consumer service: see NewService.
type ServiceConfig struct {
	// AMQPURL is the broker of the poison publisher and, unless
	// SubscriberURL is set, of the subscriber. Required.
	AMQPURL string
	// SubscriberURL, when not "", is the subscriber's broker URL instead of
	// AMQPURL: the demo and the tests route it through a fault proxy so they
	// can cut the consumer's connection alone.
	SubscriberURL string

	// Topology names the broker objects. Its zero value is production's.
	Topology Topology
	// Consumer is the service's subscription. Required.
	Consumer Consumer

	// Pool is the service's database. The idempotent middleware claims each
	// event on it and gives the handler the attempt's transaction
	// (middleware.PgxTxFromContext). Required.
	Pool *pgxpool.Pool

	// Handler is the service's handler. It runs inside the attempt's
	// transaction, at most once per event_id with a committed effect.
	// Required.
	Handler message.NoPublishHandlerFunc

	// Workers is how many subscriptions (router handlers named
	// "<consumer>-1", "<consumer>-2", …) consume the queue, each handling one
	// delivery at a time. All share the claim key's consumer name
	// Consumer.Name. Defaults to 1.
	Workers int

	// Middleware is added to the router before the recommended chain, so it
	// runs outside it (outermost first): metrics, tracing, fault injection.
	Middleware []message.HandlerMiddleware

	// Idempotent configures the idempotent middleware. Beginner defaults to
	// middleware.NewPgxBeginner(Pool, …) and Consumer to Consumer.Name.
	Idempotent middleware.Config

	// Chain configures retries (MaxRetries, intervals). Idempotent,
	// PoisonPublisher and PoisonTopic are set by NewService: the poison
	// publisher publishes on the consumer's dead-letter exchange.
	Chain middleware.ChainConfig

	// CloseTimeout bounds Close's wait for running handlers. Defaults to
	// DefaultCloseTimeout.
	CloseTimeout time.Duration

	// Logger is used by the router, the subscriber, the publisher and the
	// middleware. Defaults to watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

// Service is one running consumer service: a Watermill router whose handlers
// consume the service's queue through the recommended chain
// PoisonQueue → Retry → Recoverer → Idempotent around the handler.
type Service struct {
	// Router is the service's router, exposed for Running and plugins; Run
	// and Close drive it.
	Router *message.Router

	subscriber *Subscriber
	poison     *wamqp.Publisher
}

// NewService validates cfg (on a copy) and builds the service: a
// Subscriber on Topology.Queue(Consumer) (declaring the consumer's whole
// topology when it subscribes), a poison publisher on the consumer's
// dead-letter exchange, the idempotent middleware and the chain, and Workers
// handlers. It connects to the broker; it does not start consuming (Run).
func NewService(cfg ServiceConfig) (*Service, error) {
	switch {
	case cfg.AMQPURL == "":
		return nil, errors.New("shop: ServiceConfig.AMQPURL is required")
	case cfg.Pool == nil:
		return nil, errors.New("shop: ServiceConfig.Pool is required")
	case cfg.Handler == nil:
		return nil, errors.New("shop: ServiceConfig.Handler is required")
	case cfg.Workers < 0:
		return nil, fmt.Errorf("shop: ServiceConfig.Workers %d: must be ≥ 0", cfg.Workers)
	}
	if err := cfg.Topology.Validate(cfg.Consumer); err != nil {
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
	idem := cfg.Idempotent
	if idem.Beginner == nil {
		idem.Beginner = middleware.NewPgxBeginner(cfg.Pool, middleware.PgxBeginnerConfig{})
	}
	if idem.Consumer == "" {
		idem.Consumer = cfg.Consumer.Name
	}
	mw, err := middleware.NewIdempotent(idem, cfg.Logger)
	if err != nil {
		return nil, err
	}

	s := &Service{}
	s.poison, err = wamqp.NewPublisher(cfg.Topology.PoisonPublisherConfig(cfg.AMQPURL, cfg.Consumer), cfg.Logger)
	if err != nil {
		return nil, fmt.Errorf("shop: poison publisher: %w", err)
	}
	chainCfg := cfg.Chain
	chainCfg.Idempotent = mw
	chainCfg.PoisonPublisher = s.poison
	chainCfg.PoisonTopic = cfg.Topology.DeadLetterQueue(cfg.Consumer)
	chain, err := middleware.NewChain(chainCfg, cfg.Logger)
	if err != nil {
		_ = s.poison.Close()
		return nil, err
	}
	s.subscriber, err = cfg.Topology.NewSubscriber(cfg.SubscriberURL, cfg.Consumer, cfg.Logger)
	if err != nil {
		_ = s.poison.Close()
		return nil, fmt.Errorf("shop: subscriber: %w", err)
	}
	s.Router, err = message.NewRouter(message.RouterConfig{CloseTimeout: cfg.CloseTimeout}, cfg.Logger)
	if err != nil {
		_ = s.poison.Close()
		_ = s.subscriber.Close()
		return nil, err
	}
	s.Router.AddMiddleware(cfg.Middleware...)
	s.Router.AddMiddleware(chain...)
	queue := cfg.Topology.Queue(cfg.Consumer)
	for i := 1; i <= cfg.Workers; i++ {
		s.Router.AddNoPublisherHandler(fmt.Sprintf("%s-%d", cfg.Consumer.Name, i), queue, s.subscriber, cfg.Handler)
	}
	return s, nil
}

// Run consumes until ctx is done or Close is called, then returns (after the
// router has stopped its handlers). It returns the router's error, if any.
// Call it once.
func (s *Service) Run(ctx context.Context) error {
	err := s.Router.Run(ctx)
	if cerr := s.Router.Close(); err == nil {
		err = cerr
	}
	return err
}

// Running is closed once every handler is subscribed.
func (s *Service) Running() chan struct{} { return s.Router.Running() }

// Close stops the router (waiting up to CloseTimeout for running handlers),
// the subscriber and the poison publisher. A delivery in flight is finished
// and acked first (see Subscriber.Close); prefetched deliveries not yet
// handed out are requeued by the broker. Safe to call twice.
func (s *Service) Close() error {
	return errors.Join(s.Router.Close(), s.subscriber.Close(), s.poison.Close())
}
