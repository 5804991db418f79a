package order

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

const (
	insertOrderSQL = `INSERT INTO orders (order_id, status, version) VALUES ($1, $2, 1)`
	insertLineSQL  = `INSERT INTO order_line (order_id, line_no, sku, quantity) VALUES ($1, $2, $3, $4::numeric)`
	// changeStatusSQL moves the version forward in the same transaction as
	// the outbox row that carries it: versions follow commit order per order.
	changeStatusSQL = `UPDATE orders SET status = $2, version = version + 1, updated_at = now() WHERE order_id = $1 RETURNING version`
)
