package order

import "github.com/watermill-idempotency/idempotency/examples/shop"

// schemaSQL creates the order tables in the connection's search_path. A
// service would run it from its migration tool; Migrate runs it for the
// example. The outbox tables are watermill-sql's own (see Migrate).
const schemaSQL = `
CREATE TABLE IF NOT EXISTS orders (
    order_id   text        PRIMARY KEY,
    status     text        NOT NULL,
    version    bigint      NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS order_line (
    order_id text          NOT NULL REFERENCES orders,
    line_no  int           NOT NULL CHECK (line_no > 0),
    sku      text          NOT NULL,
    quantity numeric(12,3) NOT NULL CHECK (quantity > 0),
    PRIMARY KEY (order_id, line_no)
)`

// The same on SQLite (shop.SQLiteDB): quantities are NUMERIC (SQLite stores
// them as REAL; the demo compares them rounded to 3 decimals), timestamps
// text from SQLite's CURRENT_TIMESTAMP (whole seconds): for display only,
// nothing compares them.
const sqliteSchemaSQL = `
CREATE TABLE IF NOT EXISTS orders (
    order_id   TEXT    PRIMARY KEY,
    status     TEXT    NOT NULL,
    version    INTEGER NOT NULL,
    created_at TEXT    NOT NULL DEFAULT CURRENT_TIMESTAMP,
    updated_at TEXT    NOT NULL DEFAULT CURRENT_TIMESTAMP
);
CREATE TABLE IF NOT EXISTS order_line (
    order_id TEXT    NOT NULL REFERENCES orders,
    line_no  INTEGER NOT NULL CHECK (line_no > 0),
    sku      TEXT    NOT NULL,
    quantity NUMERIC NOT NULL CHECK (quantity > 0),
    PRIMARY KEY (order_id, line_no)
)`

// dialectSQL is the order service's SQL text of one dialect.
type dialectSQL struct{ schema, insertOrder, insertLine, changeStatus string }

func sqlFor(db shop.DB) dialectSQL {
	if db.IsSQLite() {
		return dialectSQL{
			schema:       sqliteSchemaSQL,
			insertOrder:  `INSERT INTO orders (order_id, status, version) VALUES (?, ?, 1)`,
			insertLine:   `INSERT INTO order_line (order_id, line_no, sku, quantity) VALUES (?, ?, ?, ?)`,
			changeStatus: `UPDATE orders SET status = ?2, version = version + 1, updated_at = CURRENT_TIMESTAMP WHERE order_id = ?1 RETURNING version`,
		}
	}
	return dialectSQL{schema: schemaSQL, insertOrder: insertOrderSQL, insertLine: insertLineSQL, changeStatus: changeStatusSQL}
}

const (
	insertOrderSQL = `INSERT INTO orders (order_id, status, version) VALUES ($1, $2, 1)`
	insertLineSQL  = `INSERT INTO order_line (order_id, line_no, sku, quantity) VALUES ($1, $2, $3, $4::numeric)`
	// changeStatusSQL moves the version forward in the same transaction as
	// the outbox row that carries it: versions follow commit order per order.
	changeStatusSQL = `UPDATE orders SET status = $2, version = version + 1, updated_at = now() WHERE order_id = $1 RETURNING version`
)
