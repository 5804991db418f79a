package order

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency/examples/shop"
)

// Relay defaults (RelayConfig).
const (
	DefaultConsumerGroup = "relay"
	DefaultBatchSize     = 100
	DefaultPollInterval  = 100 * time.Millisecond
	DefaultRetryInterval = 500 * time.Millisecond
)

// RelayConfig configures NewRelay.
type RelayConfig struct {
	// Pool is the order service's database. Exactly one of Pool and DB is
	// required.
	Pool *pgxpool.Pool
	// DB, instead of Pool, is the order service's database on SQLite.
	DB *sql.DB
	// OutboxTopic is the forwarder topic the service writes to. Defaults to
	// DefaultOutboxTopic.
	OutboxTopic string
	// Publisher publishes each outbox message to its event name: a
	// watermill-amqp publisher built from shop.Topology.PublisherConfig (the
	// events exchange, amqpmarshaler.Marshaler, publisher confirms). Required. The
	// relay does not close it.
	Publisher message.Publisher
	// ConsumerGroup names the relay's read position in the offsets table.
	// Relays with the same group share one position (one publishes at a time,
	// the others wait on its row lock). Defaults to DefaultConsumerGroup.
	ConsumerGroup string
	// BatchSize is how many rows one read transaction takes. A crash after
	// publishing part of a batch republishes up to that many rows. Defaults
	// to DefaultBatchSize.
	BatchSize int
	// PollInterval is the wait after a read that found nothing. Defaults to
	// DefaultPollInterval.
	PollInterval time.Duration
	// RetryInterval is the wait after a failed read or position update.
	// Defaults to DefaultRetryInterval.
	RetryInterval time.Duration
	// OffsetsAdapter stores the read position. Defaults to
	// watermill-sql's DefaultPostgreSQLOffsetsAdapter, or
	// shop.SQLiteOffsetsAdapter with DB (fault-injection tests wrap it).
	OffsetsAdapter wsql.OffsetsAdapter
	// Middleware wraps the forwarder's handler (outermost first); a nil error
	// from it means "published".
	Middleware []message.HandlerMiddleware
	// Logger defaults to watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

// Relay moves outbox rows to the broker: Watermill's forwarder reading the
// outbox with the watermill-sql v4 subscriber. See the package documentation
// for its guarantees.
type Relay struct {
	fwd *forwarder.Forwarder
}

// NewRelay validates cfg (on a copy with defaults applied) and builds the
// relay. It does not start it (Run).
func NewRelay(cfg RelayConfig) (*Relay, error) {
	db := dbOf(cfg.Pool, cfg.DB)
	switch err := db.Validate(); {
	case err != nil:
		return nil, fmt.Errorf("order: RelayConfig.Pool/DB: %w", err)
	case cfg.Publisher == nil:
		return nil, errors.New("order: RelayConfig.Publisher is required")
	case cfg.BatchSize < 0:
		return nil, fmt.Errorf("order: RelayConfig.BatchSize %d: must be ≥ 0", cfg.BatchSize)
	}
	if cfg.OutboxTopic == "" {
		cfg.OutboxTopic = DefaultOutboxTopic
	}
	if err := validateTopic(cfg.OutboxTopic); err != nil {
		return nil, fmt.Errorf("order: RelayConfig.OutboxTopic: %w", err)
	}
	if cfg.ConsumerGroup == "" {
		cfg.ConsumerGroup = DefaultConsumerGroup
	}
	if cfg.BatchSize == 0 {
		cfg.BatchSize = DefaultBatchSize
	}
	if cfg.PollInterval == 0 {
		cfg.PollInterval = DefaultPollInterval
	}
	if cfg.RetryInterval == 0 {
		cfg.RetryInterval = DefaultRetryInterval
	}
	schema, offsets := db.OutboxAdapters(cfg.BatchSize)
	if cfg.OffsetsAdapter == nil {
		cfg.OffsetsAdapter = offsets
	}
	if cfg.Logger == nil {
		cfg.Logger = watermill.NopLogger{}
	}
	sub, err := wsql.NewSubscriber(db.Beginner(), wsql.SubscriberConfig{
		ConsumerGroup:  cfg.ConsumerGroup,
		PollInterval:   cfg.PollInterval,
		ResendInterval: cfg.RetryInterval,
		RetryInterval:  cfg.RetryInterval,
		SchemaAdapter:  schema,
		OffsetsAdapter: cfg.OffsetsAdapter,
	}, cfg.Logger)
	if err != nil {
		return nil, fmt.Errorf("order: relay subscriber: %w", err)
	}
	fwd, err := forwarder.NewForwarder(sub, cfg.Publisher, cfg.Logger, forwarder.Config{
		ForwarderTopic: cfg.OutboxTopic,
		Middlewares:    cfg.Middleware,
		CloseTimeout:   10 * time.Second,
	})
	if err != nil {
		_ = sub.Close()
		return nil, fmt.Errorf("order: relay forwarder: %w", err)
	}
	return &Relay{fwd: fwd}, nil
}

// Run relays until ctx is done or Close is called. Call it once.
func (r *Relay) Run(ctx context.Context) error { return r.fwd.Run(ctx) }

// Running is closed once the relay reads the outbox.
func (r *Relay) Running() chan struct{} { return r.fwd.Running() }

// Close stops the relay (its read transaction rolls back; unconfirmed rows
// are read again by the next relay). It does not close the publisher.
func (r *Relay) Close() error { return r.fwd.Close() }

// Pending counts the outbox rows that the relay group has not yet marked
// sent: rows after its stored position. Rows of transactions still open are
// not visible and not counted.
func (s *Service) Pending(ctx context.Context, consumerGroup string) (int, error) {
	if consumerGroup == "" {
		consumerGroup = DefaultConsumerGroup
	}
	n, err := shop.OutboxPending(ctx, s.db, s.topic, consumerGroup)
	if err != nil {
		return 0, fmt.Errorf("order: %w", err)
	}
	return n, nil
}
