// Package outbox writes messages into a transactional outbox — a
// watermill-sql v4 table, in the caller's transaction — and relays them to the
// broker with Watermill's forwarder.
//
// Guarantees: a message written through Publisher exists if and only if the
// transaction commits; its UUID (the event_id) is fixed when it is written,
// so every re-send by the relay carries the same event_id. The relay delivers
// at least once: it publishes before marking the row forwarded, so a crash in
// between republishes the row (consumers deduplicate; that is the idempotent
// middleware's job). The PostgreSQL schema adapter orders rows by transaction
// id and skips rows of transactions still in flight, so a row committed late
// is not skipped (ThreeDotsLabs/watermill#311).
package outbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
)

// DefaultForwarderTopic is the watermill-sql topic (table "watermill_outbox")
// holding the outbox rows when Config.ForwarderTopic is empty.
const DefaultForwarderTopic = "outbox"

// Config configures an Outbox.
type Config struct {
	// ForwarderTopic is the watermill-sql topic the outbox rows are written
	// to and the relay reads. Defaults to DefaultForwarderTopic.
	ForwarderTopic string
	// SchemaAdapter defaults to watermill-sql's DefaultPostgreSQLSchema.
	SchemaAdapter wsql.SchemaAdapter
	// OffsetsAdapter (relay side) defaults to DefaultPostgreSQLOffsetsAdapter.
	OffsetsAdapter wsql.OffsetsAdapter
}

func (c *Config) setDefaults() {
	if c.ForwarderTopic == "" {
		c.ForwarderTopic = DefaultForwarderTopic
	}
	if c.SchemaAdapter == nil {
		c.SchemaAdapter = wsql.DefaultPostgreSQLSchema{}
	}
	if c.OffsetsAdapter == nil {
		c.OffsetsAdapter = wsql.DefaultPostgreSQLOffsetsAdapter{}
	}
}

// Validate reports the first invalid field, naming it.
func (c Config) Validate() error {
	for _, r := range c.ForwarderTopic {
		if !(r == '_' || r == '-' || r == '.' || r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9') {
			return fmt.Errorf("outbox: Config.ForwarderTopic %q: only letters, digits, '_', '-', '.'", c.ForwarderTopic)
		}
	}
	return nil
}

// Outbox writes to and relays from one outbox topic. Safe for concurrent use.
type Outbox struct {
	cfg    Config
	logger watermill.LoggerAdapter
}

// New validates cfg (a copy, defaults applied). A nil logger is NopLogger.
func New(cfg Config, logger watermill.LoggerAdapter) (*Outbox, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.setDefaults()
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	return &Outbox{cfg: cfg, logger: logger}, nil
}

// ForwarderTopic is the outbox's watermill-sql topic.
func (o *Outbox) ForwarderTopic() string { return o.cfg.ForwarderTopic }

// Publisher returns a publisher that writes into the outbox through tx (a
// watermill-sql transaction: wsql.TxFromPgx, wsql.TxFromStdSQL). Publish
// (topic, msgs…) records each message for destination topic; nothing leaves
// the database before tx commits. The outbox table must exist
// (InitializeSchema): a publisher on a transaction never creates tables.
func (o *Outbox) Publisher(tx wsql.ContextExecutor) (message.Publisher, error) {
	pub, err := wsql.NewPublisher(tx, wsql.PublisherConfig{SchemaAdapter: o.cfg.SchemaAdapter}, o.logger)
	if err != nil {
		return nil, fmt.Errorf("outbox: publisher: %w", err)
	}
	return forwarder.NewPublisher(pub, forwarder.PublisherConfig{ForwarderTopic: o.cfg.ForwarderTopic}), nil
}

// PgxPublisher is Publisher on a pgx transaction.
func (o *Outbox) PgxPublisher(tx pgx.Tx) (message.Publisher, error) {
	return o.Publisher(wsql.TxFromPgx(tx))
}

// StdPublisher is Publisher on a database/sql transaction.
func (o *Outbox) StdPublisher(tx *sql.Tx) (message.Publisher, error) {
	return o.Publisher(wsql.TxFromStdSQL(tx))
}

// InitializeSchema creates the outbox table and the relay's offsets table if
// they do not exist (watermill-sql's schema initialisation, under its
// advisory lock).
func (o *Outbox) InitializeSchema(ctx context.Context, db wsql.Beginner) error {
	sub, err := o.subscriber(db, RelayConfig{})
	if err != nil {
		return err
	}
	defer sub.Close()
	if err := sub.SubscribeInitialize(o.cfg.ForwarderTopic); err != nil {
		return fmt.Errorf("outbox: initialize schema: %w", err)
	}
	return nil
}

// RelayConfig configures NewRelay.
type RelayConfig struct {
	// ConsumerGroup lets several relays share the outbox as one group; empty
	// is watermill-sql's default group.
	ConsumerGroup string
	// Subscriber tunes the watermill-sql subscriber (poll interval, ack
	// deadline, …); SchemaAdapter/OffsetsAdapter/ConsumerGroup are set by the
	// outbox.
	Subscriber wsql.SubscriberConfig
	// Forwarder tunes Watermill's forwarder; ForwarderTopic is set by the outbox.
	Forwarder forwarder.Config
}

// NewRelay returns Watermill's forwarder from the outbox to dest: Run it (or
// run the router given in cfg.Forwarder.Router) to relay, Close to stop.
func (o *Outbox) NewRelay(db wsql.Beginner, dest message.Publisher, cfg RelayConfig) (*forwarder.Forwarder, error) {
	if dest == nil {
		return nil, errors.New("outbox: NewRelay: destination publisher is nil")
	}
	sub, err := o.subscriber(db, cfg)
	if err != nil {
		return nil, err
	}
	fc := cfg.Forwarder
	fc.ForwarderTopic = o.cfg.ForwarderTopic
	fwd, err := forwarder.NewForwarder(sub, dest, o.logger, fc)
	if err != nil {
		return nil, fmt.Errorf("outbox: relay: %w", err)
	}
	return fwd, nil
}

func (o *Outbox) subscriber(db wsql.Beginner, cfg RelayConfig) (*wsql.Subscriber, error) {
	sc := cfg.Subscriber
	sc.SchemaAdapter = o.cfg.SchemaAdapter
	sc.OffsetsAdapter = o.cfg.OffsetsAdapter
	sc.ConsumerGroup = cfg.ConsumerGroup
	sc.InitializeSchema = true
	sub, err := wsql.NewSubscriber(db, sc, o.logger)
	if err != nil {
		return nil, fmt.Errorf("outbox: subscriber: %w", err)
	}
	return sub, nil
}
