package shipping

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/examples/shop"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
	"github.com/watermill-idempotency/idempotency/versioned"
)

// Consumer is the shipping service's subscription: queue "shipping.events",
// bound to order.order.placed.v1 and order.order.status_changed.v1; claim key
// consumer "shipping".
var Consumer = shop.Consumer{Name: "shipping", Bindings: []string{shop.EventOrderPlaced, shop.EventOrderStatusChanged}}

const schemaSQL = `
CREATE TABLE IF NOT EXISTS order_status_copy (
    order_id   text        PRIMARY KEY,
    version    bigint,
    status     text        NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
)`

// Migrate creates the processed-event table named by table
// (processed.DefaultTable for the zero Config) and the status copy table in
// pool's search_path. Idempotent.
func Migrate(ctx context.Context, pool *pgxpool.Pool, table processed.Config) error {
	return MigrateDB(ctx, shop.PgxDB(pool), table)
}

// The status copy on SQLite (see shop.SQLiteDB). updated_at is for display
// only (the version orders updates): CURRENT_TIMESTAMP (seconds) will do.
const sqliteSchemaSQL = `
CREATE TABLE IF NOT EXISTS order_status_copy (
    order_id   TEXT    PRIMARY KEY,
    version    INTEGER,
    status     TEXT    NOT NULL,
    updated_at TEXT    NOT NULL DEFAULT CURRENT_TIMESTAMP
)`

// MigrateDB is Migrate on a PostgreSQL or SQLite database.
func MigrateDB(ctx context.Context, db shop.DB, table processed.Config) error {
	if err := processed.Migrate(ctx, db.Handle(), table); err != nil {
		return err
	}
	ddl := schemaSQL
	if db.IsSQLite() {
		ddl = sqliteSchemaSQL
	}
	if err := db.Exec(ctx, ddl); err != nil {
		return fmt.Errorf("shipping: migrate: %w", err)
	}
	return nil
}

// Handler applies order events to the status copy. Build it with NewHandler;
// it is safe for concurrent use.
type Handler struct {
	upsert  *versioned.Upsert
	applied atomic.Int64
	stale   atomic.Int64
}

// NewHandler returns the handler of the order_status_copy table.
func NewHandler() (*Handler, error) { return NewHandlerFor(idempotency.PostgreSQL) }

// NewHandlerFor returns the handler of the order_status_copy table in a
// database of dialect d (idempotency.PostgreSQL or idempotency.SQLite).
func NewHandlerFor(d idempotency.Dialect) (*Handler, error) {
	up, err := versioned.NewUpsert(versioned.UpsertConfig{
		Dialect:       d,
		Table:         "order_status_copy",
		KeyColumns:    []string{"order_id"},
		VersionColumn: "version",
		ValueColumns:  []string{"status"},
	})
	if err != nil {
		return nil, err
	}
	return &Handler{upsert: up}, nil
}

// statusEvent is what both event types carry for the copy. Version is a
// pointer so that a missing or null version is told apart from 0.
type statusEvent struct {
	OrderID string `json:"order_id"`
	Version *int64 `json:"version"`
	Status  string `json:"status"`
}

// ErrNoTransaction is returned when Handle runs outside the idempotent
// middleware (a wiring error). Permanent.
var ErrNoTransaction = errors.New("shipping: no transaction in the message context (is the handler attached through middleware.Consumer?)")

// Handle applies an EventOrderPlaced or EventOrderStatusChanged message to
// the copy, in the attempt's transaction (middleware.TxFromContext, so
// it works on pgx and database/sql). A version not greater than the stored
// one is Stale: nothing is written, the attempt is marked stale
// (middleware.MarkStale: recorded as middleware.OutcomeStale) and nil is
// returned (the event is acked and its claim commits). A payload without order id or status, or with
// a missing or null version (versioned.ErrVersionMissing), is a permanent
// error: dead-letter queue, no retry.
func (h *Handler) Handle(msg *message.Message) error {
	tx, ok := middleware.TxFromContext(msg.Context())
	if !ok {
		return middleware.Permanent(ErrNoTransaction)
	}
	var ev statusEvent
	if err := json.Unmarshal(msg.Payload, &ev); err != nil {
		return middleware.Permanent(fmt.Errorf("shipping: payload: %w", err))
	}
	if ev.OrderID == "" || ev.Status == "" {
		return middleware.Permanent(errors.New("shipping: payload: order_id and status required"))
	}
	outcome, err := h.upsert.Apply(msg.Context(), tx, []any{ev.OrderID}, ev.Version, []any{ev.Status})
	if err != nil {
		return err // ErrVersionMissing is permanent by itself
	}
	if outcome == versioned.Stale {
		// Recorded and logged as middleware.OutcomeStale; the claim commits.
		middleware.MarkStale(msg.Context())
		h.stale.Add(1)
	} else {
		h.applied.Add(1)
	}
	return nil
}

// Stats returns how many attempts applied a newer version and how many found
// the event stale, since NewHandler. They count attempts whose Apply
// succeeded: an attempt whose commit then failed is counted and retried.
func (h *Handler) Stats() (applied, stale int64) { return h.applied.Load(), h.stale.Load() }

// Ensure Handle fits a router handler.
var _ message.NoPublishHandlerFunc = (&Handler{}).Handle
