package order

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency/outbox"
)

// Relay defaults (RelayConfig).
const (
	DefaultBatchSize     = outbox.DefaultBatchSize
	DefaultPollInterval  = 100 * time.Millisecond
	DefaultRetryInterval = 500 * time.Millisecond
	// DefaultRetention is how long relayed events stay replayable.
	DefaultRetention = 24 * time.Hour
)

// RelayConfig configures NewRelay.
type RelayConfig struct {
	// Pool is the order service's database. Exactly one of Pool and DB is
	// required.
	Pool *pgxpool.Pool
	// DB, instead of Pool, is the order service's database on SQLite.
	DB *sql.DB
	// OutboxTopic is the outbox table the service writes to. Defaults to
	// DefaultOutboxTopic.
	OutboxTopic string
	// Publisher publishes each outbox message to its event name: a
	// watermill-amqp publisher built from shop.Topology.PublisherConfig (the
	// events exchange, amqpmarshaler.Marshaler, publisher confirms). Required. The
	// relay does not close it.
	Publisher message.Publisher
	// BatchSize is how many rows one relay transaction takes. A crash after
	// publishing part of a batch republishes up to that many rows. Defaults
	// to DefaultBatchSize.
	BatchSize int
	// PollInterval is the wait after a round that found less than a batch.
	// Defaults to DefaultPollInterval.
	PollInterval time.Duration
	// RetryInterval is the first backoff after a failed publish or round.
	// Defaults to DefaultRetryInterval.
	RetryInterval time.Duration
	// MaxBackoff caps the backoff, which doubles after each failed
	// publish of a row (outbox.RelayConfig.MaxBackoff). Defaults to
	// outbox.DefaultMaxBackoff.
	MaxBackoff time.Duration
	// MaxAttempts is the publish attempts of a row before it is
	// dead-lettered (outbox.RelayConfig.MaxAttempts). Defaults to
	// outbox.DefaultMaxAttempts.
	MaxAttempts int
	// Retention keeps relayed events replayable (Service.Replay) this long.
	// Defaults to DefaultRetention; negative keeps nothing.
	Retention time.Duration
	// PublishTimeout bounds one publish (outbox.RelayConfig.PublishTimeout);
	// a standby relay takes over twice that long after this one's process
	// died. Defaults to outbox.DefaultPublishTimeout.
	PublishTimeout time.Duration
	// Recorder receives the relay's metrics (outbox.Recorder); optional.
	Recorder outbox.Recorder
	// Logger defaults to watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

// Relay moves outbox rows to the broker: the library relay (outbox.Relay).
// See the package documentation for its guarantees.
type Relay struct {
	r *outbox.Relay
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
	}
	if cfg.OutboxTopic == "" {
		cfg.OutboxTopic = DefaultOutboxTopic
	}
	if err := validateTopic(cfg.OutboxTopic); err != nil {
		return nil, fmt.Errorf("order: RelayConfig.OutboxTopic: %w", err)
	}
	if cfg.PollInterval == 0 {
		cfg.PollInterval = DefaultPollInterval
	}
	if cfg.RetryInterval == 0 {
		cfg.RetryInterval = DefaultRetryInterval
	}
	switch {
	case cfg.Retention == 0:
		cfg.Retention = DefaultRetention
	case cfg.Retention < 0:
		cfg.Retention = 0
	}
	if cfg.Logger == nil {
		cfg.Logger = watermill.NopLogger{}
	}
	ob, err := db.Outbox(cfg.OutboxTopic, cfg.Logger)
	if err != nil {
		return nil, fmt.Errorf("order: relay: %w", err)
	}
	r, err := ob.NewRelay(cfg.Publisher, outbox.RelayConfig{
		BatchSize:      cfg.BatchSize,
		PollInterval:   cfg.PollInterval,
		RetryInterval:  cfg.RetryInterval,
		MaxBackoff:     cfg.MaxBackoff,
		MaxAttempts:    cfg.MaxAttempts,
		Retention:      cfg.Retention,
		PublishTimeout: cfg.PublishTimeout,
		Recorder:       cfg.Recorder,
	})
	if err != nil {
		return nil, fmt.Errorf("order: relay: %w", err)
	}
	return &Relay{r: r}, nil
}

// Run relays until ctx is done or Close is called. Call it once.
func (r *Relay) Run(ctx context.Context) error { return r.r.Run(ctx) }

// Running is closed once the relay has run its first round.
func (r *Relay) Running() chan struct{} { return r.r.Running() }

// Close stops the relay (a round in flight rolls back; its rows are
// published again by the next relay). It does not close the publisher.
func (r *Relay) Close() error { return r.r.Close() }

// Pending counts the outbox rows not yet relayed. Rows of transactions still
// open are not visible and not counted.
func (s *Service) Pending(ctx context.Context) (int, error) {
	n, err := s.ob.Pending(ctx)
	if err != nil {
		return 0, fmt.Errorf("order: %w", err)
	}
	return n, nil
}
