package billing

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/examples/shop"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/operation"
	"github.com/watermill-idempotency/idempotency/processed"
)

// EventConfirmationRequested is the event billing produces once a payment is
// recorded: payload ConfirmationRequested. HandleConfirmation consumes it.
const EventConfirmationRequested = "billing.payment.confirmation_requested.v1"

// Consumer is the billing service's subscription to placed orders (claim key
// consumer "billing"), with a reconciliation queue ("billing.events.reconcile")
// for the charges whose outcome stays uncertain.
var Consumer = shop.Consumer{Name: "billing", Bindings: []string{shop.EventOrderPlaced}, Reconcile: true}

// MailerConsumer is the subscription of the confirmation sender (claim key
// consumer "billing-mailer").
var MailerConsumer = shop.Consumer{Name: "billing-mailer", Bindings: []string{EventConfirmationRequested}}

// Defaults of Config.
const (
	// DefaultUnitPriceMinor is the price of one unit of any SKU, in minor
	// units: 10.00.
	DefaultUnitPriceMinor = 1000
	// DefaultCurrency is the currency of every charge.
	DefaultCurrency = "EUR"
)

// ErrNoTransaction is returned when HandleOrderPlaced runs outside the
// consumer's chain (middleware.Consumer; a wiring error). Permanent.
var ErrNoTransaction = errors.New("billing: no transaction in the message context (is the handler attached through middleware.Consumer?)")

// ConfirmationRequested is the payload of EventConfirmationRequested.
type ConfirmationRequested struct {
	OrderID     string `json:"order_id"`
	ChargeID    string `json:"charge_id"`
	AmountMinor int64  `json:"amount_minor"`
	Currency    string `json:"currency"`
}

// chargeParams are the parameters that define a charge request: what the
// operation key's fingerprint covers. Nothing that varies between attempts
// (event id, delivery time) belongs here.
type chargeParams struct {
	AmountMinor int64  `json:"amount_minor"`
	Currency    string `json:"currency"`
}

// Config configures a Service (New).
type Config struct {
	// Runner records the charges (operation keys "charge:<order_id>"). Give
	// it a pool of its own, or size the shared one for two connections per
	// concurrent handler: the middleware's transaction holds one while Do
	// holds another for the provider call. Required.
	Runner *operation.Runner
	// Provider is the payment provider. Required.
	Provider *Provider
	// Mailer sends confirmations (HandleConfirmation). Required.
	Mailer *Mailer
	// UnitPriceMinor is the price of one unit, in minor units; an order's
	// amount is the sum of its quantities times it, rounded half up to a
	// minor unit. Defaults to DefaultUnitPriceMinor.
	UnitPriceMinor int64
	// Currency is the currency of every charge. Defaults to DefaultCurrency.
	Currency string
	// Dialect is the SQL dialect of the handler's database (the ledger):
	// idempotency.PostgreSQL (the default) or idempotency.SQLite.
	Dialect idempotency.Dialect
	// Logger defaults to watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

// Service is the billing consumer: it charges placed orders once and asks
// for one confirmation e-mail per charge. Safe for concurrent use.
type Service struct {
	runner   *operation.Runner
	provider *Provider
	mailer   *Mailer
	unit     int64
	currency string
	payment  string // insertPaymentSQL of the dialect
	logger   watermill.LoggerAdapter

	mu       sync.Mutex
	expected map[string]struct{}
}

// New validates cfg (on a copy with defaults applied) and returns the
// service.
func New(cfg Config) (*Service, error) {
	switch {
	case cfg.Runner == nil:
		return nil, errors.New("billing: Config.Runner is required")
	case cfg.Provider == nil:
		return nil, errors.New("billing: Config.Provider is required")
	case cfg.Mailer == nil:
		return nil, errors.New("billing: Config.Mailer is required")
	case cfg.UnitPriceMinor < 0:
		return nil, fmt.Errorf("billing: Config.UnitPriceMinor %d: must be > 0", cfg.UnitPriceMinor)
	}
	if cfg.UnitPriceMinor == 0 {
		cfg.UnitPriceMinor = DefaultUnitPriceMinor
	}
	if cfg.Currency == "" {
		cfg.Currency = DefaultCurrency
	}
	if cfg.Logger == nil {
		cfg.Logger = watermill.NopLogger{}
	}
	return &Service{
		runner: cfg.Runner, provider: cfg.Provider, mailer: cfg.Mailer,
		unit: cfg.UnitPriceMinor, currency: cfg.Currency, payment: insertPaymentSQLFor(cfg.Dialect), logger: cfg.Logger,
		expected: map[string]struct{}{},
	}, nil
}

const schemaSQL = `
CREATE TABLE IF NOT EXISTS billing_payment (
    order_id     text        PRIMARY KEY,
    charge_id    text        NOT NULL,
    amount_minor bigint      NOT NULL CHECK (amount_minor > 0),
    currency     text        NOT NULL,
    event_id     uuid        NOT NULL,
    recorded_at  timestamptz NOT NULL DEFAULT now()
)`

// insertPaymentSQL is the local ledger row. The key is the order, not the
// event: another event for the same order (a replay under a new event id)
// finds the charge recorded by the operation and adds no row.
const insertPaymentSQL = `INSERT INTO billing_payment (order_id, charge_id, amount_minor, currency, event_id)
VALUES ($1, $2, $3, $4, $5) ON CONFLICT (order_id) DO NOTHING`

// Migrate creates, in pool's database and search_path, the processed-event
// table named by table (processed.DefaultTable for the zero Config), the
// runner's operations table and the billing_payment ledger. Idempotent. The
// runner's own pool must reach the same database.
func Migrate(ctx context.Context, pool *pgxpool.Pool, table processed.Config, runner *operation.Runner) error {
	return MigrateDB(ctx, shop.PgxDB(pool), table, runner)
}

// The ledger on SQLite (see shop.SQLiteDB). recorded_at is for display only
// (nothing compares it): SQLite's CURRENT_TIMESTAMP (whole seconds) will do.
const sqliteSchemaSQL = `
CREATE TABLE IF NOT EXISTS billing_payment (
    order_id     TEXT    PRIMARY KEY,
    charge_id    TEXT    NOT NULL,
    amount_minor INTEGER NOT NULL CHECK (amount_minor > 0),
    currency     TEXT    NOT NULL,
    event_id     TEXT    NOT NULL,
    recorded_at  TEXT    NOT NULL DEFAULT CURRENT_TIMESTAMP
)`

func insertPaymentSQLFor(d idempotency.Dialect) string {
	if d == idempotency.SQLite {
		return `INSERT INTO billing_payment (order_id, charge_id, amount_minor, currency, event_id)
VALUES (?, ?, ?, ?, ?) ON CONFLICT (order_id) DO NOTHING`
	}
	return insertPaymentSQL
}

// MigrateDB is Migrate on a PostgreSQL or SQLite database; runner, when not
// nil, is migrated in db too. On SQLite give the runner a database file of
// its own (migrate it there): SQLite has one writer per file, and the
// runner records its "started" row while the handler's transaction holds
// the write lock of the service's file.
func MigrateDB(ctx context.Context, db shop.DB, table processed.Config, runner *operation.Runner) error {
	if err := processed.Migrate(ctx, db.Handle(), table); err != nil {
		return err
	}
	if runner != nil {
		if err := runner.Migrate(ctx); err != nil {
			return err
		}
	}
	ddl := schemaSQL
	if db.IsSQLite() {
		ddl = sqliteSchemaSQL
	}
	if err := db.Exec(ctx, ddl); err != nil {
		return fmt.Errorf("billing: migrate: %w", err)
	}
	return nil
}

// ChargeKey is the operation key of an order's charge: "charge:<order_id>".
// One charge per order: the key names that operation, the same for every
// delivery, retry and replay of any event about the order.
func ChargeKey(orderID string) (operation.Key, error) { return operation.NewKey("charge", orderID) }

// confirmationNamespace is the UUIDv5 namespace of confirmation event ids.
var confirmationNamespace = uuid.MustParse("6f1c2b7e-2d0a-4b7f-9a53-0c9e1d6b4a11")

// ConfirmationEventID is the event id of the confirmation of an order's
// charge: a UUIDv5 of the charge key, so every attempt, and every event that
// replays the same order, produces the same id, and the mailer's claim sends
// one e-mail per charge. (A UUIDv5 is not time-ordered; the middleware dates
// the event by its occurred_at.)
func ConfirmationEventID(key operation.Key) uuid.UUID {
	return uuid.NewSHA1(confirmationNamespace, []byte(key.String()))
}

// HandleOrderPlaced charges one shop.OrderPlaced message. Run it as a
// Watermill handler through a middleware.Consumer, whose transaction it
// writes the ledger row in, and add operation.RouteUncertain to the chain
// (ConsumerConfig.AfterPoison).
//
//  1. The amount is the sum of the line quantities times the unit price.
//     A payload that is not a valid order is a permanent error.
//  2. The charge runs through the operation runner with key
//     "charge:<order_id>" and fingerprint {amount_minor, currency}, on the
//     runner's own connection, and with a reconcile function that asks the
//     provider by key: a provider timeout is retried (transient) and the retry
//     finds the charge instead of making another one.
//  3. The charge is written to billing_payment in the attempt's transaction.
//  4. It returns one EventConfirmationRequested message (event id
//     ConfirmationEventID): the middleware writes it to the outbox in the
//     same transaction, or the router publishes it after the commit. The
//     e-mail is sent by HandleConfirmation, never here (see the package doc).
//
// Errors from the runner are returned wrapped, keeping their class
// (conflict: permanent; in progress: transient; uncertain without answer:
// for the reconciliation topic).
func (s *Service) HandleOrderPlaced(msg *message.Message) ([]*message.Message, error) {
	ctx := msg.Context()
	q, ok := shop.TxFromContext(ctx) // pgx.Tx or *sql.Tx, as a shop.Querier
	if !ok {
		return nil, middleware.Permanent(ErrNoTransaction)
	}
	var ev shop.OrderPlaced
	if err := json.Unmarshal(msg.Payload, &ev); err != nil {
		return nil, middleware.Permanent(fmt.Errorf("billing: payload: %w", err))
	}
	if ev.OrderID == "" || len(ev.Lines) == 0 {
		return nil, middleware.Permanent(errors.New("billing: payload: order id and at least one line required"))
	}
	amount, err := amountMinor(ev.Lines, s.unit)
	if err != nil {
		return nil, middleware.Permanent(fmt.Errorf("billing: order %s: %w", ev.OrderID, err))
	}
	key, err := ChargeKey(ev.OrderID)
	if err != nil {
		return nil, middleware.Permanent(fmt.Errorf("billing: order %s: %w", ev.OrderID, err))
	}
	s.mu.Lock()
	s.expected[key.String()] = struct{}{}
	s.mu.Unlock()

	res, err := s.runner.Do(ctx, key, chargeParams{AmountMinor: amount, Currency: s.currency},
		s.charge(amount), operation.WithReconcile(s.Reconcile))
	if err != nil {
		return nil, fmt.Errorf("billing: order %s: %w", ev.OrderID, err)
	}
	if _, err := q.Exec(ctx, s.payment, ev.OrderID, res.Reference, amount, s.currency, msg.UUID); err != nil {
		return nil, fmt.Errorf("billing: order %s: record payment: %w", ev.OrderID, err)
	}
	conf, err := marshaler.NewMessageWithID(ConfirmationEventID(key), EventConfirmationRequested, time.Now().UTC(),
		ConfirmationRequested{OrderID: ev.OrderID, ChargeID: res.Reference, AmountMinor: amount, Currency: s.currency})
	if err != nil {
		return nil, fmt.Errorf("billing: order %s: confirmation: %w", ev.OrderID, err)
	}
	s.logger.Debug("Order charged", watermill.LogFields{"order_id": ev.OrderID, "charge_id": res.Reference, "origin": string(res.Origin)})
	return []*message.Message{conf}, nil
}

// charge is the operation's call: the provider's answers mapped to the
// operation's error classes.
func (s *Service) charge(amount int64) operation.CallFunc {
	return func(ctx context.Context, key string) (operation.Result, error) {
		c, err := s.provider.Charge(ctx, key, amount, s.currency)
		switch {
		case errors.Is(err, ErrDeclined), errors.Is(err, ErrKeyReused):
			return operation.Result{}, operation.Rejected(err)
		case err != nil:
			return operation.Result{}, operation.Timeout(err)
		}
		return operation.Result{Reference: c.ID}, nil
	}
}

// Reconcile is the charge's operation.ReconcileFunc: it asks the provider for
// the charge made with rec.Key. Found: the charge's id is the result. Not
// found: operation.ErrNotFound (the runner then charges, with the same key).
// A failed lookup is transient. A reconciliation consumer can use it too.
func (s *Service) Reconcile(ctx context.Context, rec operation.Record) (operation.Result, error) {
	c, ok, err := s.provider.Lookup(ctx, rec.Key)
	switch {
	case err != nil:
		return operation.Result{}, operation.Transient(err)
	case !ok:
		return operation.Result{}, operation.ErrNotFound
	}
	return operation.Result{Reference: c.ID}, nil
}

// HandleConfirmation sends the confirmation e-mail of one
// EventConfirmationRequested message through the Mailer. Run it under the
// consumer's chain (a middleware.Consumer named MailerConsumer.Name): the claim on the
// confirmation's event id sends one e-mail per charge, except in the window
// described in the package doc. A payload that is not a confirmation is a
// permanent error.
func (s *Service) HandleConfirmation(msg *message.Message) error {
	var c ConfirmationRequested
	if err := json.Unmarshal(msg.Payload, &c); err != nil {
		return middleware.Permanent(fmt.Errorf("billing: confirmation payload: %w", err))
	}
	if c.OrderID == "" || c.ChargeID == "" {
		return middleware.Permanent(errors.New("billing: confirmation payload: order id and charge id required"))
	}
	return s.mailer.Send(msg.Context(), Mail{
		To:      "customer+" + c.OrderID + "@example.com",
		Subject: "Payment received for order " + c.OrderID,
		Body:    fmt.Sprintf("We charged %s %s (charge %s).", formatMinor(c.AmountMinor), c.Currency, c.ChargeID),
	})
}

// ExpectedCharges is the number of distinct orders this service was asked to
// charge (valid OrderPlaced payloads seen, whatever happened next): what the
// provider's Charges should equal once every message is handled.
func (s *Service) ExpectedCharges() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.expected)
}

// Provider is the service's payment provider (for its counters).
func (s *Service) Provider() *Provider { return s.provider }

// Mailer is the service's mailer (for its counters).
func (s *Service) Mailer() *Mailer { return s.mailer }

// amountMinor is Σ quantity × unit, in minor units, rounded half up once at
// the end. Quantities follow shop.ValidateQuantity (at most 3 decimals) and
// are summed exactly in thousandths.
func amountMinor(lines []shop.OrderLine, unit int64) (int64, error) {
	var thousandths int64
	for _, l := range lines {
		if err := shop.ValidateQuantity(l.Quantity); err != nil {
			return 0, fmt.Errorf("line %d: %w", l.LineNo, err)
		}
		ip, fp, _ := strings.Cut(l.Quantity, ".")
		n, err := strconv.ParseInt(ip+(fp + "000")[:3], 10, 64)
		if err != nil {
			return 0, fmt.Errorf("line %d: quantity %q: %w", l.LineNo, l.Quantity, err)
		}
		if thousandths > math.MaxInt64-n {
			return 0, errors.New("amount out of range")
		}
		thousandths += n
	}
	if thousandths > (math.MaxInt64-500)/unit {
		return 0, errors.New("amount out of range")
	}
	return (thousandths*unit + 500) / 1000, nil
}

func formatMinor(m int64) string {
	return fmt.Sprintf("%d.%02d", m/100, m%100)
}
