package stock

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sort"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/examples/shop"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
)

// Consumer is the stock service's subscription: queue "stock.events", bound
// to order.order.placed.v1; claim key consumer "stock".
var Consumer = shop.Consumer{Name: "stock", Bindings: []string{shop.EventOrderPlaced}}

const schemaSQL = `
CREATE TABLE IF NOT EXISTS reservation (
    id          bigserial     PRIMARY KEY,
    order_id    text          NOT NULL,
    line_no     int           NOT NULL,
    sku         text          NOT NULL,
    quantity    numeric(12,3) NOT NULL CHECK (quantity > 0),
    event_id    uuid          NOT NULL,
    reserved_at timestamptz   NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS reservation_order_idx ON reservation (order_id, line_no);
CREATE TABLE IF NOT EXISTS stock_level (
    sku      text          PRIMARY KEY,
    reserved numeric(14,3) NOT NULL DEFAULT 0
)`

const (
	insertReservationSQL = `INSERT INTO reservation (order_id, line_no, sku, quantity, event_id) VALUES ($1, $2, $3, $4::numeric, $5)`
	addReservedSQL       = `INSERT INTO stock_level (sku, reserved) VALUES ($1, $2::numeric)
ON CONFLICT (sku) DO UPDATE SET reserved = stock_level.reserved + excluded.reserved`
)

// The stock tables on SQLite (see shop.SQLiteDB). reserved_at is for display
// only (nothing compares it): CURRENT_TIMESTAMP (whole seconds) will do.
const sqliteSchemaSQL = `
CREATE TABLE IF NOT EXISTS reservation (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    order_id    TEXT    NOT NULL,
    line_no     INTEGER NOT NULL,
    sku         TEXT    NOT NULL,
    quantity    NUMERIC NOT NULL CHECK (quantity > 0),
    event_id    TEXT    NOT NULL,
    reserved_at TEXT    NOT NULL DEFAULT CURRENT_TIMESTAMP
);
CREATE INDEX IF NOT EXISTS reservation_order_idx ON reservation (order_id, line_no);
CREATE TABLE IF NOT EXISTS stock_level (
    sku      TEXT    PRIMARY KEY,
    reserved NUMERIC NOT NULL DEFAULT 0
)`

const (
	sqliteInsertReservationSQL = `INSERT INTO reservation (order_id, line_no, sku, quantity, event_id) VALUES (?, ?, ?, CAST(? AS NUMERIC), ?)`
	sqliteAddReservedSQL       = `INSERT INTO stock_level (sku, reserved) VALUES (?, CAST(? AS NUMERIC))
ON CONFLICT (sku) DO UPDATE SET reserved = stock_level.reserved + excluded.reserved`
)

// Migrate creates the processed-event table named by table
// (processed.DefaultTable for the zero Config) and the stock tables in
// pool's search_path. Idempotent.
func Migrate(ctx context.Context, pool *pgxpool.Pool, table processed.Config) error {
	return MigrateDB(ctx, shop.PgxDB(pool), table)
}

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
		return fmt.Errorf("stock: migrate: %w", err)
	}
	return nil
}

// HandlerFor is the stock handler of a dialect: Handle on PostgreSQL (pgx),
// HandleSQLite on SQLite.
func HandlerFor(d idempotency.Dialect) message.NoPublishHandlerFunc {
	if d == idempotency.SQLite {
		return HandleSQLite
	}
	return Handle
}

// ErrNoTransaction is returned when Handle runs outside the idempotent
// middleware (a wiring error): it refuses to write without the claim's
// transaction. Permanent.
var ErrNoTransaction = errors.New("stock: no transaction in the message context (is the handler attached through middleware.Consumer on pgx?)")

// Handle reserves the lines of one EventOrderPlaced message: one reservation
// row per line and the SKU's reserved quantity increased, in the attempt's
// transaction (all statements in one round trip). Lines are applied in SKU
// order so that concurrent orders lock stock rows in the same order.
//
// A payload that is not an OrderPlaced (bad JSON, no order id, no lines, a
// quantity that fails shop.ValidateQuantity) is a permanent error: no retry
// can fix it, and the message goes to the dead-letter queue. Database errors
// are returned as they are, for the chain to classify.
func Handle(msg *message.Message) error {
	ctx := msg.Context()
	tx, ok := middleware.PgxTxFromContext(ctx)
	if !ok {
		return middleware.Permanent(ErrNoTransaction)
	}
	ev, lines, err := decode(msg)
	if err != nil {
		return err
	}
	b := &pgx.Batch{}
	for _, l := range lines {
		b.Queue(insertReservationSQL, ev.OrderID, l.LineNo, l.SKU, l.Quantity, msg.UUID)
		b.Queue(addReservedSQL, l.SKU, l.Quantity)
	}
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return fmt.Errorf("stock: reserve order %s: %w", ev.OrderID, err)
	}
	return nil
}

// HandleSQLite is Handle on SQLite: the same rows, one statement at a time in
// the attempt's database/sql transaction (middleware.SQLTxFromContext).
func HandleSQLite(msg *message.Message) error {
	ctx := msg.Context()
	tx, ok := middleware.SQLTxFromContext(ctx)
	if !ok {
		return middleware.Permanent(ErrNoTransaction)
	}
	ev, lines, err := decode(msg)
	if err != nil {
		return err
	}
	for _, l := range lines {
		if _, err := tx.ExecContext(ctx, sqliteInsertReservationSQL, ev.OrderID, l.LineNo, l.SKU, l.Quantity, msg.UUID); err != nil {
			return fmt.Errorf("stock: reserve order %s: %w", ev.OrderID, err)
		}
		if _, err := tx.ExecContext(ctx, sqliteAddReservedSQL, l.SKU, l.Quantity); err != nil {
			return fmt.Errorf("stock: reserve order %s: %w", ev.OrderID, err)
		}
	}
	return nil
}

// decode validates an OrderPlaced payload and returns its lines in SKU
// order; its errors are permanent.
func decode(msg *message.Message) (shop.OrderPlaced, []shop.OrderLine, error) {
	var ev shop.OrderPlaced
	if err := json.Unmarshal(msg.Payload, &ev); err != nil {
		return ev, nil, middleware.Permanent(fmt.Errorf("stock: payload: %w", err))
	}
	if ev.OrderID == "" || len(ev.Lines) == 0 {
		return ev, nil, middleware.Permanent(fmt.Errorf("stock: payload: order id and at least one line required"))
	}
	lines := append([]shop.OrderLine(nil), ev.Lines...)
	for _, l := range lines {
		if err := shop.ValidateQuantity(l.Quantity); err != nil {
			return ev, nil, middleware.Permanent(fmt.Errorf("stock: order %s line %d: %w", ev.OrderID, l.LineNo, err))
		}
		if l.SKU == "" || l.LineNo <= 0 {
			return ev, nil, middleware.Permanent(fmt.Errorf("stock: order %s: line %d: sku and positive line_no required", ev.OrderID, l.LineNo))
		}
	}
	sort.SliceStable(lines, func(i, j int) bool { return lines[i].SKU < lines[j].SKU })
	return ev, lines, nil
}
