package order

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/examples/shop"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/outbox"
)

// DefaultOutboxTopic is the outbox table (outbox.Config.Table) of the
// service: "order_outbox", with its relay tables order_outbox_dead,
// order_outbox_relayed and order_outbox_relay.
const DefaultOutboxTopic = "order_outbox"

// Config configures the order service (New).
type Config struct {
	// Pool is the order service's database; its search_path must reach the
	// tables Migrate creates. Exactly one of Pool and DB is required.
	Pool *pgxpool.Pool
	// DB, instead of Pool, is the order service's database on SQLite
	// (database/sql with modernc.org/sqlite; see shop.SQLiteDB): the outbox
	// then uses the library outbox's SQLite dialect.
	DB *sql.DB
	// OutboxTopic is the outbox table. Letters, digits and _ only. Defaults
	// to DefaultOutboxTopic.
	OutboxTopic string
	// Logger defaults to watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

// Service places orders and changes their status, writing each event to the
// outbox in the same transaction. Safe for concurrent use.
type Service struct {
	db     shop.DB
	topic  string
	ob     *outbox.Outbox
	sql    dialectSQL
	logger watermill.LoggerAdapter
}

// New validates cfg (on a copy with defaults applied) and returns the service.
func New(cfg Config) (*Service, error) {
	db := dbOf(cfg.Pool, cfg.DB)
	if err := db.Validate(); err != nil {
		return nil, fmt.Errorf("order: Config.Pool/DB: %w", err)
	}
	if cfg.OutboxTopic == "" {
		cfg.OutboxTopic = DefaultOutboxTopic
	}
	if err := validateTopic(cfg.OutboxTopic); err != nil {
		return nil, fmt.Errorf("order: Config.OutboxTopic: %w", err)
	}
	if cfg.Logger == nil {
		cfg.Logger = watermill.NopLogger{}
	}
	ob, err := db.Outbox(cfg.OutboxTopic, cfg.Logger)
	if err != nil {
		return nil, fmt.Errorf("order: %w", err)
	}
	return &Service{db: db, topic: cfg.OutboxTopic, ob: ob, sql: sqlFor(db), logger: cfg.Logger}, nil
}

func validateTopic(t string) error {
	for _, r := range t {
		if !(r == '_' || r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9') {
			return fmt.Errorf("%q: letters, digits and _ only", t)
		}
	}
	if t == "" || len(t) > 40 {
		return fmt.Errorf("%q: 1 to 40 characters", t)
	}
	return nil
}

func dbOf(pool *pgxpool.Pool, db *sql.DB) shop.DB {
	if db != nil {
		return shop.DB{Pool: pool, SQL: db, Dialect: idempotency.SQLite}
	}
	return shop.PgxDB(pool)
}

// Migrate creates the order tables and the outbox's tables (the library
// outbox's embedded migrations, outbox.Outbox.Migrate). Idempotent.
func (s *Service) Migrate(ctx context.Context) error {
	if err := s.db.Exec(ctx, s.sql.schema); err != nil {
		return fmt.Errorf("order: migrate: %w", err)
	}
	if err := s.ob.Migrate(ctx); err != nil {
		return fmt.Errorf("order: migrate outbox: %w", err)
	}
	return nil
}

// OutboxTopic is the outbox table.
func (s *Service) OutboxTopic() string { return s.topic }

// Outbox is the service's outbox (relay, replay, pending counts).
func (s *Service) Outbox() *outbox.Outbox { return s.ob }

// PlaceOrder inserts the order (status "placed", version 1) and its lines,
// and writes an EventOrderPlaced event to the outbox, in one transaction. It
// returns the event's id (a UUIDv7). Quantities must pass
// shop.ValidateQuantity; lines are numbered 1…n in the given order when their
// LineNo is 0. A duplicate OrderID fails (unique violation) and writes nothing.
func (s *Service) PlaceOrder(ctx context.Context, orderID string, lines []shop.OrderLine) (eventID string, err error) {
	if strings.TrimSpace(orderID) == "" {
		return "", errors.New("order: empty order id")
	}
	if len(lines) == 0 {
		return "", errors.New("order: an order needs at least one line")
	}
	ev := shop.OrderPlaced{OrderID: orderID, Version: 1, Status: "placed", Lines: make([]shop.OrderLine, len(lines))}
	for i, l := range lines {
		if l.LineNo == 0 {
			l.LineNo = i + 1
		}
		if err := shop.ValidateQuantity(l.Quantity); err != nil {
			return "", fmt.Errorf("order: line %d: %w", l.LineNo, err)
		}
		ev.Lines[i] = l
	}
	msg, err := marshaler.NewMessage(shop.EventOrderPlaced, ev)
	if err != nil {
		return "", err
	}
	err = s.db.InTx(ctx, func(tx shop.Tx) error {
		if _, err := tx.Querier.Exec(ctx, s.sql.insertOrder, orderID, ev.Status); err != nil {
			return err
		}
		for _, l := range ev.Lines {
			if _, err := tx.Querier.Exec(ctx, s.sql.insertLine, orderID, l.LineNo, l.SKU, l.Quantity); err != nil {
				return err
			}
		}
		return s.writeOutbox(ctx, tx.Outbox, shop.EventOrderPlaced, msg)
	})
	if err != nil {
		return "", fmt.Errorf("order: place %s: %w", orderID, err)
	}
	return msg.UUID, nil
}

// ChangeStatus sets the order's status, increments its version, and writes
// an EventOrderStatusChanged event carrying the new version to the outbox, in
// one transaction. It returns the new version and the event's id. An unknown
// order fails with an error wrapping shop.ErrNoRows (and pgx.ErrNoRows on
// PostgreSQL).
func (s *Service) ChangeStatus(ctx context.Context, orderID, status string) (version int64, eventID string, err error) {
	if status == "" {
		return 0, "", errors.New("order: empty status")
	}
	err = s.db.InTx(ctx, func(tx shop.Tx) error {
		if err := tx.Querier.QueryRow(ctx, s.sql.changeStatus, orderID, status).Scan(&version); err != nil {
			return err
		}
		msg, err := marshaler.NewMessage(shop.EventOrderStatusChanged,
			shop.OrderStatusChanged{OrderID: orderID, Version: version, Status: status})
		if err != nil {
			return err
		}
		eventID = msg.UUID
		return s.writeOutbox(ctx, tx.Outbox, shop.EventOrderStatusChanged, msg)
	})
	if err != nil {
		return 0, "", fmt.Errorf("order: change status of %s: %w", orderID, err)
	}
	return version, eventID, nil
}

// PublishInTx writes msgs to the outbox in the caller's transaction tx, for
// the relay to publish to topic (an event name) once tx commits; nothing is
// sent if tx rolls back. Build each message with marshaler.NewMessage, so its
// event_id is fixed here, before the row is written. It is how PlaceOrder
// and ChangeStatus publish, exported for code that owns its transaction.
//
// Under the hood: the library outbox's publisher on tx (outbox.Publisher;
// it never commits or rolls back: the caller owns tx): one row per message
// (event_id, topic, payload, metadata) in the table OutboxTopic. The INSERT
// runs on ctx. The publisher holds no resources; one per call is cheap.
func (s *Service) PublishInTx(ctx context.Context, tx pgx.Tx, topic string, msgs ...*message.Message) error {
	return s.writeOutbox(ctx, wsql.TxFromPgx(tx), topic, msgs...)
}

// PublishInStdTx is PublishInTx for a database/sql transaction (SQLite).
func (s *Service) PublishInStdTx(ctx context.Context, tx *sql.Tx, topic string, msgs ...*message.Message) error {
	return s.writeOutbox(ctx, wsql.TxFromStdSQL(tx), topic, msgs...)
}

func (s *Service) writeOutbox(ctx context.Context, tx wsql.ContextExecutor, topic string, msgs ...*message.Message) error {
	pub, err := s.ob.Publisher(tx)
	if err != nil {
		return err
	}
	for _, m := range msgs {
		m.SetContext(ctx) // each INSERT runs on its message's context
	}
	return pub.Publish(topic, msgs...)
}
